"""Mooncake's TransferEngine API (`mooncake.engine.TransferEngine`) backed by the local
mooncaked: the daemon serves this process's registered memory to peers and moves its
transfers, so that an engine needs no transfer engine of its own.

    from mooncaked.transfer_engine import TransferEngine
    engine = TransferEngine()
    engine.initialize("10.0.0.5", "P2PHANDSHAKE", "tcp", "")   # segment "10.0.0.5:<rpc_port>"
    engine.register_memory(tensor.data_ptr(), tensor.nbytes)
    engine.transfer_sync_write("10.0.0.6:15432", tensor.data_ptr(), peer_address, nbytes)

The daemon is found at $MOONCAKED_ADDRESS, else at its default Unix socket; it must be the
Unix socket (the daemon learns this process's pid from it, and copies the registered memory
with process_vm_readv / process_vm_writev, which needs the daemon to run as this user or hold
CAP_SYS_PTRACE; with kernel.yama.ptrace_scope = 1, initialize() names the daemon as this
process's tracer). Peers, real Mooncake processes included, see an ordinary Mooncake TCP
segment (wire/PROTOCOL.md sections 8 and 9).

Return conventions are Mooncake's: 0 or -1; a batch id, 0 on failure; transfer_check_status
1 done, 0 pending, -1 failed, -2 timed out. Every method is safe from several threads, and
threads do not wait for each other: the thread that called initialize() uses the connection
that owns the segment, every other thread a connection of its own, attached to the segment
(te_attach), opened on its first call and closed when the thread has ended (at the next
thread's first call) or at close().
"""

from __future__ import annotations

import ctypes
import enum
import logging
import mmap
import os
import threading
import weakref
from typing import Sequence

from mooncaked.client import calls
from mooncaked.client.blocking import BlockingClient
from mooncaked.errors import MooncakedError

__all__ = ["TransferEngine", "TransferNotify", "TransferOpcode"]

log = logging.getLogger("mooncaked.transfer_engine")

DEFAULT_DAEMON_ADDRESS = "unix:/run/mooncaked/mooncaked.sock"
P2P_HANDSHAKE = "P2PHANDSHAKE"
_PR_SET_PTRACER = 0x59616D61
_YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"

# TransferStatusEnum values the daemon reports per request (transfer/endpoint.py).
_COMPLETED = 4
_TIMEOUT = 5


class TransferOpcode(enum.IntEnum):
    Read = 0
    Write = 1


class TransferNotify:
    """A notification: sent to the target segment after a transfer, read with get_notifies."""

    def __init__(self, name: str = "", msg: str = "") -> None:
        self.name = name
        self.msg = msg

    def __repr__(self) -> str:
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"


class TransferEngine:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards the fields below, not the calls
        self._client: BlockingClient | None = None  # the connection that owns the segment
        self._owner_thread = 0
        self._address = ""
        self._attach_token = ""
        self._segment = ""
        self._rpc_port = 0
        # Other threads' connections, attached to the segment: (thread, connection).
        self._attached: list[tuple[weakref.ref, BlockingClient]] = []
        self._thread = threading.local()
        self._managed: dict[int, mmap.mmap] = {}  # allocate_managed_buffer's, by address

    # -- set-up -----------------------------------------------------------------------------

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str,
                   device_name: str) -> int:
        """Open this process's segment on the daemon. local_hostname: the address peers
        reach it at (`host` or `host:rpc_port`); metadata_server: "P2PHANDSHAKE" or
        http://host:port/path; protocol: "tcp"."""
        with self._lock:
            if self._client is not None:
                log.error("initialize: already initialized (segment %s)", self._segment)
                return -1
            address = os.environ.get("MOONCAKED_ADDRESS") or DEFAULT_DAEMON_ADDRESS
            try:
                client = BlockingClient.connect(address, client_name=f"transfer-engine:"
                                                f"{local_hostname}", timeout_s=None,
                                                map_segments=False)
            except (OSError, ValueError, MooncakedError) as e:
                log.error("initialize: cannot reach mooncaked at %s: %s", address, e)
                return -1
            try:
                opened = client._run(calls.simple("te_open", {
                    "local_hostname": str(local_hostname),
                    "metadata_server": str(metadata_server), "protocol": str(protocol),
                    "device_name": str(device_name)}))
            except MooncakedError as e:
                client.close()
                log.error("initialize: %s", e)
                return -1
            _allow_tracer(opened["daemon_pid"])
            self._client = client
            self._owner_thread = threading.get_ident()
            self._address = address
            self._attach_token = opened["attach_token"]
            self._segment = opened["segment"]
            self._rpc_port = opened["rpc_port"]
            return 0

    def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str,
                       device_name: str, metadata_type: str) -> int:
        """initialize() with the metadata scheme apart ("http" or "P2PHANDSHAKE")."""
        if metadata_server == P2P_HANDSHAKE or metadata_type == P2P_HANDSHAKE:
            server = P2P_HANDSHAKE
        elif metadata_type == "http" and not metadata_server.startswith("http://"):
            server = f"http://{metadata_server}"
        else:
            server = metadata_server
        return self.initialize(local_hostname, server, protocol, device_name)

    def get_rpc_port(self) -> int:
        return self._rpc_port

    def get_segment_name(self) -> str:
        """This process's segment name (`host:rpc_port` in P2P mode)."""
        return self._segment

    def close(self) -> None:
        """Close the segment (the daemon stops serving it); also when the process exits."""
        with self._lock:
            client, self._client = self._client, None
            attached, self._attached = self._attached, []
        for _, connection in attached:
            connection.close()
        if client is not None:
            client.close()
        for region in self._managed.values():
            region.close()
        self._managed.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- memory -----------------------------------------------------------------------------

    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        return self._code("te_register", [[buffer_addr, capacity]], location)

    def unregister_memory(self, buffer_addr: int) -> int:
        return self._code("te_unregister", [buffer_addr])

    def batch_register_memory(self, buffer_addresses: Sequence[int], capacities: Sequence[int],
                              location: str = "*") -> int:
        if len(buffer_addresses) != len(capacities):
            log.error("batch_register_memory: %d addresses, %d capacities",
                      len(buffer_addresses), len(capacities))
            return -1
        return self._code("te_register", [[a, c] for a, c in zip(buffer_addresses,
                                                                   capacities)], location)

    def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> int:
        return self._code("te_unregister", list(buffer_addresses))

    def allocate_managed_buffer(self, length: int) -> int:
        """A registered buffer of `length` bytes from anonymous memory; 0 on failure."""
        if not isinstance(length, int) or length <= 0:
            return 0
        region = mmap.mmap(-1, length)
        address = ctypes.addressof(ctypes.c_char.from_buffer(region))
        if self.register_memory(address, length) != 0:
            region.close()
            return 0
        self._managed[address] = region
        return address

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        region = self._managed.get(buffer_addr)
        if region is None or len(region) != length:
            log.error("free_managed_buffer: no managed buffer of %d bytes at %#x", length,
                      buffer_addr)
            return -1
        self.unregister_memory(buffer_addr)
        del self._managed[buffer_addr]
        region.close()
        return 0

    def write_bytes_to_buffer(self, buffer_addr: int, data: bytes, length: int) -> int:
        if length < 0 or length > len(data):
            return -1
        ctypes.memmove(buffer_addr, data, length)
        return 0

    def read_bytes_from_buffer(self, buffer_addr: int, length: int) -> bytes:
        return ctypes.string_at(buffer_addr, length)

    def get_first_buffer_address(self, segment_name: str) -> int:
        """The address of the named segment's first buffer (this one's, or a peer's); 0 when
        it has none or cannot be reached."""
        buffers = self._call("te_buffers", segment_name)
        return buffers[0][0] if buffers else 0

    # -- transfers --------------------------------------------------------------------------

    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                            length: int, transport_hint: str = "") -> int:
        return self._sync(target_hostname, TransferOpcode.Write, [buffer],
                          [peer_buffer_address], [length])

    def transfer_sync_read(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                           length: int, transport_hint: str = "") -> int:
        return self._sync(target_hostname, TransferOpcode.Read, [buffer],
                          [peer_buffer_address], [length])

    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                      length: int, opcode: TransferOpcode, notify: TransferNotify | None = None,
                      transport_hint: str = "") -> int:
        return self._sync(target_hostname, opcode, [buffer], [peer_buffer_address], [length],
                          notify)

    def batch_transfer_sync_write(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        return self._sync(target_hostname, TransferOpcode.Write, buffers,
                          peer_buffer_addresses, lengths)

    def batch_transfer_sync_read(self, target_hostname: str, buffers: Sequence[int],
                                 peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                 transport_hint: str = "") -> int:
        return self._sync(target_hostname, TransferOpcode.Read, buffers,
                          peer_buffer_addresses, lengths)

    def batch_transfer_sync(self, target_hostname: str, buffers: Sequence[int],
                            peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                            opcode: TransferOpcode, notify: TransferNotify | None = None,
                            transport_hint: str = "") -> int:
        return self._sync(target_hostname, opcode, buffers, peer_buffer_addresses, lengths,
                          notify)

    def batch_transfer_async_write(self, target_hostname: str, buffers: Sequence[int],
                                   peer_buffer_addresses: Sequence[int],
                                   lengths: Sequence[int], transport_hint: str = "") -> int:
        return self._submit(target_hostname, TransferOpcode.Write, buffers,
                            peer_buffer_addresses, lengths)

    def batch_transfer_async_read(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int],
                                  lengths: Sequence[int], transport_hint: str = "") -> int:
        return self._submit(target_hostname, TransferOpcode.Read, buffers,
                            peer_buffer_addresses, lengths)

    def batch_transfer_async(self, target_hostname: str, buffers: Sequence[int],
                             peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                             opcode: TransferOpcode, transport_hint: str = "") -> int:
        return self._submit(target_hostname, opcode, buffers, peer_buffer_addresses, lengths)

    def transfer_submit_write(self, target_hostname: str, buffer: int,
                              peer_buffer_address: int, length: int,
                              transport_hint: str = "") -> int:
        return self._submit(target_hostname, TransferOpcode.Write, [buffer],
                            [peer_buffer_address], [length])

    def get_batch_transfer_status(self, batch_ids: Sequence[int]) -> int:
        """Wait for every listed batch: 0 when all completed, -1 when one failed or timed out
        (or is unknown). The batches are freed."""
        result = 0
        for batch_id in batch_ids:
            statuses = self._call("te_wait", batch_id)
            if statuses is None or any(s[0] != _COMPLETED for s in statuses):
                result = -1
        return result

    def transfer_check_status(self, batch_id: int) -> int:
        """1 done, 0 pending, -1 failed, -2 timed out; a finished batch is freed."""
        reply = self._call("te_status", batch_id)
        if reply is None:
            return -1
        if not reply["done"]:
            return 0
        self._call("te_free", batch_id)
        states = [s[0] for s in reply["statuses"]]
        if all(state == _COMPLETED for state in states):
            return 1
        return -2 if _TIMEOUT in states else -1

    # -- notifications and probes -----------------------------------------------------------

    def get_notifies(self) -> list[TransferNotify]:
        notifies = self._call("te_notifies")
        return [TransferNotify(name, msg) for name, msg in notifies or []]

    def send_probe(self, peer_server_name: str) -> int:
        return 0 if self._call("te_probe", peer_server_name) else -1

    # -- the connection ---------------------------------------------------------------------

    def _connection(self) -> BlockingClient | None:
        """This thread's connection to the segment: the owner's for the thread that called
        initialize(), else one attached on first use. None (logged) when there is none."""
        with self._lock:
            owner, owner_thread = self._client, self._owner_thread
        if owner is None:
            log.error("the engine is not initialized")
            return None
        if threading.get_ident() == owner_thread:
            return owner
        mine = getattr(self._thread, "connection", None)
        if mine is not None and not mine.closed and getattr(self._thread, "owner", None) is owner:
            return mine
        try:
            mine = BlockingClient.connect(self._address, client_name=f"transfer-engine:"
                                          f"{self._segment}", timeout_s=None,
                                          map_segments=False)
        except (OSError, ValueError, MooncakedError) as e:
            log.error("cannot reach mooncaked at %s: %s", self._address, e)
            return None
        try:
            mine._run(calls.simple("te_attach", self._segment, self._attach_token))
        except MooncakedError as e:
            mine.close()
            log.error("cannot attach to segment %s: %s", self._segment, e)
            return None
        with self._lock:
            if self._client is not owner:  # closed meanwhile
                mine.close()
                return None
            ended = [c for t, c in self._attached if t() is None or not t().is_alive()]
            self._attached = [(t, c) for t, c in self._attached if c not in ended]
            self._attached.append((weakref.ref(threading.current_thread()), mine))
        for connection in ended:
            connection.close()
        self._thread.connection, self._thread.owner = mine, owner
        return mine

    def _call(self, method: str, *params):
        """The method's result, or None (logged) when it failed."""
        client = self._connection()
        if client is None:
            return None
        try:
            return client._run(calls.simple(method, *params))
        except MooncakedError as e:
            log.error("%s: %s", method, e)
            return None

    def _code(self, method: str, *params) -> int:
        client = self._connection()
        if client is None:
            return -1
        try:
            client._run(calls.simple(method, *params))
        except MooncakedError as e:
            log.error("%s: %s", method, e)
            return -1
        return 0

    @staticmethod
    def _requests(target: str, opcode, buffers, peer_addresses, lengths) -> list | None:
        if not len(buffers) == len(peer_addresses) == len(lengths):
            log.error("%d buffers, %d peer addresses, %d lengths: they must match",
                      len(buffers), len(peer_addresses), len(lengths))
            return None
        return [[int(opcode), b, target, p, n] for b, p, n in zip(buffers, peer_addresses,
                                                                 lengths)]

    def _submit(self, target, opcode, buffers, peer_addresses, lengths, notify=None) -> int:
        requests = self._requests(target, opcode, buffers, peer_addresses, lengths)
        if requests is None:
            return 0
        params = [requests] if notify is None else [requests, [notify.name, notify.msg]]
        batch_id = self._call("te_submit", *params)
        return batch_id or 0

    def _sync(self, target, opcode, buffers, peer_addresses, lengths, notify=None) -> int:
        requests = self._requests(target, opcode, buffers, peer_addresses, lengths)
        if requests is None:
            return -1
        params = [requests] if notify is None else [requests, [notify.name, notify.msg]]
        client = self._connection()
        if client is None:
            return -1
        try:
            batch_id = client._run(calls.simple("te_submit", *params))
            statuses = client._run(calls.simple("te_wait", batch_id))
        except MooncakedError as e:
            log.error("transfer to %s: %s", target, e)
            return -1
        failed = [s for s in statuses if s[0] != _COMPLETED]
        if failed:
            log.error("transfer to %s: %d of %d requests failed: %s", target, len(failed),
                      len(statuses), failed[0][2])
            return -1
        return 0


def _allow_tracer(daemon_pid: int) -> None:
    """With Yama's ptrace_scope 1, only a process's ancestors may read its memory unless it
    names another: name the daemon, so that it can reach the registered memory."""
    try:
        with open(_YAMA_SCOPE) as f:
            scope = int(f.read().strip() or 0)
    except (OSError, ValueError):
        return
    if scope == 1:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(daemon_pid), 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PTRACER, %d) failed: %s", daemon_pid,
                        os.strerror(ctypes.get_errno()))
