"""Drives a real Mooncake TransferEngine (the mooncake-transfer-engine wheel) for the interop
tests: run with the interpreter of tools/engines/.venv-mooncake (never the project's), it reads
one JSON command per line on stdin and answers one JSON line on stdout.

Commands: {"op": "start", "buffer_bytes": N} initializes in P2PHANDSHAKE mode over tcp and
registers one buffer of N bytes (zeroed): {"segment", "address"}; with "metadata" (an
http://.../metadata URL) and "name", it uses that metadata server and segment name instead. {"op": "fill", "offset",
"hex"} and {"op": "dump", "offset", "length"} write and read that buffer locally.
{"op": "write"|"read", "segment", "offset", "remote_address", "length"[, "notify"]} is one
transfer_sync between the buffer at offset and the peer: {"rc"}. {"op": "batch_write"|
"batch_read", "segment", "offsets", "remote_addresses", "lengths"} is batch_transfer_sync_*.
{"op": "probe", "segment"}, {"op": "notifies"}, {"op": "quit"}.
"""

import ctypes
import json
import sys

from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode


def main() -> None:
    engine = TransferEngine()
    buffer = None
    address = 0
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "start":
            metadata = command.get("metadata", "P2PHANDSHAKE")
            if engine.initialize(command.get("name", "127.0.0.1"), metadata, "tcp", "") != 0:
                reply = {"error": "initialize failed"}
            else:
                buffer = ctypes.create_string_buffer(command["buffer_bytes"])
                address = ctypes.addressof(buffer)
                rc = engine.register_memory(address, command["buffer_bytes"])
                segment = (f"127.0.0.1:{engine.get_rpc_port()}" if metadata == "P2PHANDSHAKE"
                           else command["name"])
                reply = {"rc": rc, "segment": segment, "address": address}
        elif op == "fill":
            data = bytes.fromhex(command["hex"])
            ctypes.memmove(address + command["offset"], data, len(data))
            reply = {"rc": 0}
        elif op == "dump":
            reply = {"hex": ctypes.string_at(address + command["offset"],
                                             command["length"]).hex()}
        elif op in ("write", "read"):
            opcode = TransferOpcode.Write if op == "write" else TransferOpcode.Read
            notify = command.get("notify")
            notify = TransferNotify(notify[0], notify[1]) if notify else None
            rc = engine.transfer_sync(command["segment"], address + command["offset"],
                                      command["remote_address"], command["length"], opcode,
                                      notify)
            reply = {"rc": rc}
        elif op in ("batch_write", "batch_read"):
            call = (engine.batch_transfer_sync_write if op == "batch_write"
                    else engine.batch_transfer_sync_read)
            rc = call(command["segment"], [address + o for o in command["offsets"]],
                      command["remote_addresses"], command["lengths"])
            reply = {"rc": rc}
        elif op == "probe":
            reply = {"rc": engine.send_probe(command["segment"])}
        elif op == "notifies":
            reply = {"notifies": [[n.name, n.msg] for n in engine.get_notifies()]}
        elif op == "quit":
            print(json.dumps({"rc": 0}), flush=True)
            return
        else:
            reply = {"error": f"unknown op {op!r}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
