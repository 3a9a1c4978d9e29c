"""The replay section (run.py --only replay): a conversation trace replayed against each store,
shaped like a KV-cache connector's work (replay_worker.py does the replay itself).

    trace      ../shared/data/fast25_conversation_trace.jsonl (FAST'25 Mooncake trace format:
               one request a line, `hash_ids` = its 512-token blocks, `input_length` tokens);
               the first --replay-requests requests, in trace order
    block      bytes of one 512-token block of a named model's KV cache:
               layers x KV heads x head dim x 2 (K and V) x dtype bytes x 512 (printed)
    capacity   --replay-capacity GiB per store; 0 (default) = unlimited: room for every
               distinct block of the replayed requests at 80 % of the capacity (under every
               store's eviction watermark), so the hit rate must equal the trace's ideal
    systems    mooncaked (batch_exists / batch_get_into / batch_put_from over the Unix socket,
               busy polling off), Mooncake in-process (batch_is_exist / batch_get_into /
               batch_put_from into its own segment), Mooncake as a client of mooncake_client,
               Redis (pipelines over its Unix socket, maxmemory = capacity, allkeys-lru)

Each trial starts every store fresh (empty, with exactly that capacity) and the systems'
trials alternate (A B C A B C ...). Reported per system: requests/s, blocks/s and GB/s moved
(bytes fetched + bytes stored, over the sum of the requests' timed calls), p50/p99 per request,
hit rate by blocks and by tokens against the ideal (every block ever stored still there), the
servers' CPU per request, failed operations and the read-back check of every stored block.
"""

from __future__ import annotations

import os
import shutil

import report
from common import GiB, MiB
from procs import Noise, run_one
from replay_worker import BLOCK_TOKENS, ideal, load_trace
from servers import (start_mooncake_client, start_mooncake_master, start_mooncaked,
                     start_redis)

HERE = os.path.dirname(os.path.abspath(__file__))
TRACE = os.path.normpath(os.path.join(HERE, "..", "..", "..", "shared", "data",
                                      "fast25_conversation_trace.jsonl"))

# name: (layers, KV heads, head dim, dtype bytes) from each model's config.json
MODELS = {
    "pythia-14m": (6, 4, 32, 2),        # EleutherAI/pythia-14m, fp16 (MHA: 4 heads)
    "qwen2.5-0.5b": (24, 2, 64, 2),     # Qwen/Qwen2.5-0.5B, bf16 (GQA: 2 KV heads)
    "llama-3.2-1b": (16, 8, 64, 2),     # meta-llama/Llama-3.2-1B, bf16
    "llama-3.1-8b": (32, 8, 128, 2),    # meta-llama/Llama-3.1-8B, bf16
}
HEADROOM = 0.8  # unlimited capacity: the distinct blocks fill 80 % of it


def block_bytes(model: str) -> int:
    layers, heads, dim, dtype = MODELS[model]
    return layers * heads * dim * 2 * dtype * BLOCK_TOKENS


def shape_text(model: str) -> str:
    layers, heads, dim, dtype = MODELS[model]
    return (f"{model}: {layers} layers x {heads} KV heads x {dim} head dim x 2 (K, V) x "
            f"{dtype} B x {BLOCK_TOKENS} tokens = {block_bytes(model):,} B "
            f"({report.human_size(block_bytes(model))}) per block")


def config_defaults(cfg) -> None:
    cfg.replay_trace = TRACE
    cfg.replay_model = "pythia-14m"
    cfg.replay_requests = 20 if cfg.quick else 50
    cfg.replay_capacity = 0  # bytes; 0 = unlimited
    cfg.replay_max_batch_bytes = 128 * MiB


def add_arguments(ap) -> None:
    ap.add_argument("--replay-model", choices=sorted(MODELS), default=None,
                    help="model shape that sets the block size (default pythia-14m)")
    ap.add_argument("--replay-requests", type=int, default=None, metavar="N",
                    help="replay the trace's first N requests (default 50; --quick 20)")
    ap.add_argument("--replay-capacity", type=float, default=None, metavar="GIB",
                    help="capacity of each store in GiB; 0 = unlimited (default)")
    ap.add_argument("--replay-trace", default=None, metavar="JSONL",
                    help=f"the trace (default {TRACE})")


def apply_arguments(cfg, args) -> None:
    if args.replay_model:
        cfg.replay_model = args.replay_model
    if args.replay_requests:
        cfg.replay_requests = args.replay_requests
    if args.replay_capacity is not None:
        cfg.replay_capacity = int(args.replay_capacity * GiB)
    if args.replay_trace:
        cfg.replay_trace = os.path.abspath(args.replay_trace)


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


class ReplaySection:
    def __init__(self, bench) -> None:
        self.b = bench
        self.cfg = bench.cfg
        self.info = bench.info.setdefault("replay", {})

    def run(self, pl, systems: set) -> None:
        cfg, b = self.cfg, self.b
        if not os.path.exists(cfg.replay_trace):
            raise RuntimeError(f"no trace at {cfg.replay_trace}")
        size = block_bytes(cfg.replay_model)
        trace = load_trace(cfg.replay_trace, cfg.replay_requests)
        best = ideal(trace)
        unlimited = cfg.replay_capacity == 0
        capacity = (int(best["unique_blocks"] * size / HEADROOM) + 64 * MiB if unlimited
                    else cfg.replay_capacity)
        capacity = -(-capacity // MiB) * MiB
        need = capacity + 4 * cfg.replay_max_batch_bytes
        if need > 0.8 * mem_available():
            raise RuntimeError(
                f"replay: {report.human_size(capacity)} per store does not fit in this "
                f"machine's available memory ({mem_available() / GiB:.1f} GiB); use fewer "
                f"--replay-requests, a smaller --replay-model or a --replay-capacity")
        self.info.update({"model": cfg.replay_model, "shape": shape_text(cfg.replay_model),
                          "block_bytes": size, "requests": len(trace),
                          "trace": cfg.replay_trace, "ideal": best, "capacity_bytes": capacity,
                          "unlimited": unlimited, "placement": pl.name,
                          "max_batch_bytes": cfg.replay_max_batch_bytes})
        b.log(f"[{pl.name}] replay: {shape_text(cfg.replay_model)}; {len(trace)} requests, "
              f"{best['blocks']} blocks ({best['unique_blocks']} distinct), ideal hit rate "
              f"{100 * best['hit_rate_blocks']:.1f} % of blocks; capacity "
              f"{report.human_size(capacity)} per store"
              + (" (unlimited: every distinct block fits)" if unlimited else ""))
        order = [s for s in ("mooncaked", "mooncake", "mooncake-daemon", "redis")
                 if s.split("-")[0] in systems]
        acc = {s: {"out": [], "noise": []} for s in order}
        for trial in range(cfg.trials):
            for system in order:
                try:
                    with Noise(acc[system]["noise"]):
                        out = self.trial(pl, system, capacity, size, trial)
                    acc[system]["out"].append(out)
                    b.log(f"[{pl.name}] replay {system} trial {trial}: "
                          f"{report.fmt(out['requests_s'])} requests/s, "
                          f"{report.fmt(out['gbps'])} GB/s, hit rate "
                          f"{100 * out['hit_rate_blocks']:.1f} % of blocks")
                except Exception as exc:  # noqa: BLE001 (a failed trial, kept and shown)
                    b.info["errors"].append(f"replay {system} [{pl.name}] trial {trial}: "
                                            f"{type(exc).__name__}: {exc}")
                    acc[system]["out"].append(None)
        for system, a in acc.items():
            self.rows(pl, system, a["out"], a["noise"], size, best)

    def run_small_dram(self, pl, base: str, dram_fraction: float, tier_sections) -> None:
        """The ssd section's replay: DRAM holds `dram_fraction` of the distinct blocks, the
        SSD all of them (at 80 % of its capacity);
        mooncaked with its SSD tier (`tier_sections(directory, capacity)`), mooncaked without
        it, Mooncake in-process without and with its SSD offload. Rows are named
        replay_small_*; the hit rates are compared with the ideal (unlimited capacity)."""
        cfg, b = self.cfg, self.b
        size = block_bytes(cfg.replay_model)
        trace = load_trace(cfg.replay_trace, cfg.replay_requests)
        best = ideal(trace)
        dram = max(64 * MiB, -(-int(best["unique_blocks"] * size * dram_fraction) // MiB) * MiB)
        ssd_capacity = -(-int(best["unique_blocks"] * size / HEADROOM) // GiB) * GiB
        info = b.info.setdefault("ssd", {}).setdefault("replay", {})
        info.update({"model": cfg.replay_model, "shape": shape_text(cfg.replay_model),
                     "placement": pl.name,
                     "requests": len(trace), "ideal": best, "dram_bytes": dram,
                     "ssd_bytes": ssd_capacity, "dram_fraction": dram_fraction})
        b.log(f"[{pl.name}] ssd replay: {len(trace)} requests, {best['unique_blocks']} "
              f"distinct blocks of {report.human_size(size)}; DRAM "
              f"{report.human_size(dram)} ({100 * dram_fraction:.0f} % of them), SSD "
              f"{report.human_size(ssd_capacity)}; ideal hit rate "
              f"{100 * best['hit_rate_tokens']:.1f} % of tokens")
        variants = [("mooncaked+ssd", "mooncaked", "ssd"), ("mooncaked", "mooncaked", None),
                    ("mooncake+ssd", "mooncake", "ssd"), ("mooncake", "mooncake", None)]
        outs = {name: [] for name, _, _ in variants}
        for trial in range(cfg.trials):
            for name, system, tier in variants:
                directory = os.path.join(base, f"replay-{name}-{trial}")
                extra = None
                if tier:
                    os.makedirs(directory, exist_ok=True)
                    extra = (tier_sections(directory, ssd_capacity) if system == "mooncaked"
                             else {"ssd_offload_path": directory})
                try:
                    out = self.trial(pl, system, dram, size, trial, extra=extra)
                    b.log(f"[{pl.name}] ssd replay {name} trial {trial}: "
                          f"{report.fmt(out['requests_s'])} requests/s, hit rate "
                          f"{100 * out['hit_rate_tokens']:.1f} % of tokens")
                    outs[name].append(out)
                except Exception as exc:  # noqa: BLE001 (a failed trial, kept and shown)
                    b.info["errors"].append(f"ssd replay {name} [{pl.name}] trial {trial}: "
                                            f"{type(exc).__name__}: {exc}")
                    outs[name].append(None)
                finally:
                    shutil.rmtree(directory, ignore_errors=True)
        res = b.results
        for name, trials in outs.items():
            ok = [o for o in trials if o is not None]
            pad = [None] * (len(trials) - len(ok))
            # A put refused for want of room is the store's answer at this capacity (shown),
            # not a failure of the run; wrong bytes and failed reads are.
            failed = sum(o["exists_failed"] + o["get_failed"] + o["fetched_bad"] for o in ok)
            bad = sum(o["verify"]["bad"] + o["fetched_bad"] for o in ok)
            checked = sum(o["verify"]["stored"] - o["verify"]["evicted"] for o in ok)
            note = (f"DRAM {report.human_size(dram)}"
                    + (f", SSD {report.human_size(ssd_capacity)}" if "+ssd" in name else "")
                    + f"; ideal {100 * best['hit_rate_tokens']:.2f} % of tokens; puts refused "
                      f"(no room): {sum(o['put_failed'] for o in ok)}")
            res.add(pl.name, name, "replay_small_hit_tokens", None, "%",
                    [100 * o["hit_rate_tokens"] for o in ok] + pad, n=len(trace), note=note,
                    errors=failed, checked=checked, bad=bad)
            res.add(pl.name, name, "replay_small_requests", None, "req/s",
                    [o["requests_s"] for o in ok] + pad, [o["p50_us"] for o in ok],
                    [o["p99_us"] for o in ok], n=len(trace), note=note, errors=failed)
        info["systems"] = {name: [None if o is None else
                                  {k: v for k, v in o.items() if k != "ideal"} for o in trials]
                           for name, trials in outs.items()}

    def trial(self, pl, system: str, capacity: int, size: int, trial: int,
              extra: dict | None = None) -> dict:
        """extra: mooncaked's extra config sections (its SSD tier), or for Mooncake
        {"ssd_offload_path": DIR} (its master with --enable_offload, clients with
        enable_ssd_offload)."""
        cfg, b = self.cfg, self.b
        tag = f"replay-{pl.name}-{system}-{trial}-{os.getpid()}"
        args = {"system": system, "trace": cfg.replay_trace, "requests": cfg.replay_requests,
                "block_bytes": size, "tag": tag, "max_batch_bytes": cfg.replay_max_batch_bytes,
                "local_buffer_bytes": 64 * MiB}
        servers, env, python = [], None, b.vpy
        workdir = os.path.join(b.workdir, tag)
        try:
            if system == "mooncaked":
                server = start_mooncaked(b.py, workdir, pl, capacity, None,
                                         b.logfile("replay-mooncaked"), busy_poll=False,
                                         extra_sections=extra)
                servers.append(server)
                args.update(address=server.connect["address"],
                            server_pids=[server.process.pid])
                python = b.py
                b.info["servers"][f"replay mooncaked [{pl.name}]"] = server.command
            elif system.startswith("mooncake"):
                env = b.venv_env
                offload = (extra or {}).get("ssd_offload_path")
                master = start_mooncake_master(
                    b.vpy, pl, b.logfile("mooncake_master-replay"),
                    ["--enable_offload=true", "--offload_on_evict=true"] if offload else ())
                if offload:
                    args["ssd_offload_path"] = offload
                servers.append(master)
                args.update(master.connect, server_pids=[master.process.pid])
                b.info["servers"][f"replay mooncake_master [{pl.name}]"] = master.command
                if system == "mooncake":
                    args["segment_bytes"] = capacity
                else:
                    daemon = start_mooncake_client(b.vpy, pl, master, capacity,
                                                   b.logfile("mooncake_client-replay"), env)
                    servers.insert(0, daemon)
                    args.update(client_addr=daemon.connect["client_addr"],
                                segment_bytes=capacity,
                                mem_pool_bytes=2 * cfg.replay_max_batch_bytes + 64 * MiB,
                                server_pids=[master.process.pid, daemon.process.pid])
                    b.info["servers"][f"replay mooncake_client [{pl.name}]"] = daemon.command
                    run_one(b.vpy, "prefill", dict(args, system="mooncake-daemon"),
                            b.logfile("replay-mooncake-daemon"), pl.clients, env)
            elif system == "redis":
                os.makedirs(workdir, exist_ok=True)
                server = start_redis(workdir, pl, maxmemory=capacity)
                servers.append(server)
                args.update(unix_socket=server.connect["unix_socket"],
                            server_pids=[server.process.pid])
                b.info["servers"][f"replay redis-server [{pl.name}]"] = server.command
            return run_one(python, "replay", args, b.logfile(f"replay-{system}"), pl.clients,
                           env, timeout_s=1800)
        finally:
            for server in servers:
                server.stop()
                if "shm_dir" in server.connect:
                    shutil.rmtree(server.connect["shm_dir"], ignore_errors=True)
            shutil.rmtree(workdir, ignore_errors=True)

    def rows(self, pl, system: str, outs: list, noise: list, size: int, best: dict) -> None:
        ok = [o for o in outs if o is not None]
        pad = [None] * (len(outs) - len(ok))
        res = self.b.results
        failed = sum(o["exists_failed"] + o["get_failed"] + o["put_failed"] + o["fetched_bad"]
                     + (o["vanished"] if self.info["unlimited"] else 0) for o in ok)
        checked = sum(o["verify"]["stored"] - o["verify"]["evicted"] for o in ok)
        bad = sum(o["verify"]["bad"] + o["fetched_bad"] for o in ok)
        cpu = [{"units": o["requests"], "bytes": o["bytes_moved"], "wall_s": o["total_s"],
                "server_cpu_s": o["server_cpu_s"], "client_cpu_s": o["client_cpu_s"]}
               for o in ok]
        vanished = sum(o["vanished"] for o in ok)
        evicted = sum(o["verify"]["evicted"] for o in ok)
        note = (f"{self.info['shape']}; {self.info['requests']} requests; capacity "
                f"{report.human_size(self.info['capacity_bytes'])}"
                + (" (unlimited)" if self.info["unlimited"] else
                   f"; {evicted} stored blocks evicted by the end, {vanished} evicted between "
                   "exists and get"))
        common = dict(noise=noise, errors=failed, checked=checked, bad=bad)
        res.add(pl.name, system, "replay_requests", None, "req/s",
                [o["requests_s"] for o in ok] + pad, [o["p50_us"] for o in ok],
                [o["p99_us"] for o in ok], n=self.info["requests"], note=note, cpu=cpu,
                **common)
        res.add(pl.name, system, "replay_blocks", None, "blocks/s",
                [o["blocks_s"] for o in ok] + pad, n=self.info["requests"],
                note="blocks fetched + blocks stored", **common)
        res.add(pl.name, system, "replay_gbps", None, "GB/s", [o["gbps"] for o in ok] + pad,
                n=self.info["requests"], note="bytes fetched + bytes stored", **common)
        for key, op in (("hit_rate_blocks", "replay_hit_blocks"),
                        ("hit_rate_tokens", "replay_hit_tokens")):
            res.add(pl.name, system, op, None, "%", [100 * o[key] for o in ok] + pad,
                    n=self.info["requests"],
                    note=f"ideal {100 * best[key]:.2f} % (every block ever stored still there)",
                    **common)
        self.info.setdefault("systems", {})[system] = [
            None if o is None else {k: v for k, v in o.items() if k != "ideal"} for o in outs]
