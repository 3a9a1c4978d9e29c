"""The daemon's own cost of a put, in instructions, measured with callgrind.

Starts one daemon (plain, or a 1-node cluster with fsync = "none") on the stdlib asyncio loop
under `valgrind --tool=callgrind`, makes N sequential 4 KiB puts from a client in this process,
stops it and reads the instruction total. Two runs (N1 and N2 puts) cancel start-up and
shutdown: (total(N2) - total(N1)) / (N2 - N1) is the cost of one put.

    python tools/bench/putcost.py [--mode plain|cluster|both] [--puts 100,600] [--profile FILE]

--rate runs the daemon once without valgrind, pinned to CPU 0 (the client to CPU 1), and
prints the sequential puts per second of the N2 puts (wall clock: noisy on a shared machine).

--profile FILE runs the daemon once without valgrind under cProfile (N2 puts) and writes the
stats there (python -m pstats FILE) to see which calls a put makes.
"""

from __future__ import annotations

import argparse
import glob
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from mooncaked.client.blocking import BlockingClient  # noqa: E402

VALUE = b"v" * 4096


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def write_config(path: str, workdir: str, mode: str) -> int:
    port = free_port("127.0.0.1")
    lines = ["[node]", 'name = "putcost"',
             "[server]", f"tcp_port = {port}", 'loop = "asyncio"',
             "[store]", "eviction_interval_ms = 5000",
             "[segments]", f"size_bytes = {64 << 20}", f'shm_dir = "{workdir}/shm"',
             "[metrics]", f"port = {free_port('127.0.0.1')}",
             "[log]", 'level = "warning"']
    if mode == "cluster":
        peer = free_port("127.0.0.1")
        lines += ["[cluster]", "enabled = true", "node_id = 1", 'peer_host = "127.0.0.1"',
                  f"peer_port = {peer}", f'initial_members = "1@127.0.0.1:{peer}"',
                  f'data_dir = "{workdir}/raft"', 'fsync = "none"', "tick_ms = 500",
                  "election_ticks = 10"]
    os.makedirs(f"{workdir}/shm", exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return port


def run_once(mode: str, puts: int, wrapper: list[str]) -> tuple[str, float]:
    workdir = tempfile.mkdtemp(prefix="putcost-")
    config = os.path.join(workdir, "mooncaked.toml")
    port = write_config(config, workdir, mode)
    env = dict(os.environ, PYTHONPATH=REPO)
    log = open(os.path.join(workdir, "daemon.log"), "wb")
    process = subprocess.Popen([*wrapper, "-m", "mooncaked", "--config", config],
                               cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        client = connect(f"127.0.0.1:{port}", process)
        with client:
            deadline = time.monotonic() + 300
            while True:  # the first put also waits for the node to lead
                try:
                    if client.put("warm", VALUE):
                        break
                except Exception:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("the warm-up put never succeeded")
                time.sleep(0.2)
            started = time.perf_counter()
            for i in range(puts):
                if not client.put(f"k{i}", VALUE):
                    raise RuntimeError(f"put k{i} failed")
            elapsed_s = time.perf_counter() - started
    finally:
        os.kill(process.pid, signal.SIGTERM)
        process.wait(300)
        log.close()
    return workdir, elapsed_s


def connect(address: str, process: subprocess.Popen) -> BlockingClient:
    deadline = time.monotonic() + 300
    while True:
        try:
            return BlockingClient.connect(address, timeout_s=120)
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def callgrind_total(mode: str, puts: int) -> int:
    out = tempfile.mktemp(prefix="putcost-callgrind-")
    workdir, _ = run_once(mode, puts, ["valgrind", "--tool=callgrind", "--trace-children=no",
                                    f"--callgrind-out-file={out}", sys.executable])
    total = 0
    for path in glob.glob(out + "*"):
        with open(path) as f:
            for line in f:
                if line.startswith(("summary:", "totals:")):
                    total = max(total, int(line.split()[1]))
        os.unlink(path)
    if not total:
        raise RuntimeError(f"no callgrind total; see {workdir}/daemon.log")
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("plain", "cluster", "both"), default="both")
    parser.add_argument("--puts", default="100,600")
    parser.add_argument("--profile", default="")
    parser.add_argument("--rate", action="store_true")
    args = parser.parse_args()
    low, high = (int(x) for x in args.puts.split(","))
    modes = ["plain", "cluster"] if args.mode == "both" else [args.mode]
    if args.profile:
        for mode in modes:
            path = f"{args.profile}.{mode}"
            run_once(mode, high, [sys.executable, "-m", "cProfile", "-o", path])
            print(f"{mode}: profile in {path}")
        return 0
    if args.rate:
        os.sched_setaffinity(0, {1})
        rates = {}
        for mode in modes:
            _, elapsed_s = run_once(mode, high, ["taskset", "-c", "0", sys.executable])
            rates[mode] = high / elapsed_s
            print(f"{mode}: {rates[mode]:.0f} puts/s", flush=True)
        if len(rates) == 2:
            print(f"plain / cluster: {rates['plain'] / rates['cluster']:.2f}x")
        return 0
    per_put = {}
    for mode in modes:
        totals = [callgrind_total(mode, n) for n in (low, high)]
        per_put[mode] = (totals[1] - totals[0]) / (high - low)
        print(f"{mode}: {totals[0]} / {totals[1]} instructions at {low} / {high} puts: "
              f"{per_put[mode] / 1000:.1f}k per put", flush=True)
    if len(per_put) == 2:
        print(f"cluster / plain: {per_put['cluster'] / per_put['plain']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
