"""The replay worker (run.py --only replay; dispatched by workers.py): one client replays the
first `requests` requests of a conversation trace (FAST'25 Mooncake trace format: each request
lists the hashes of its 512-token blocks) against one store, in trace order:

    1. batch-exists every block of the request;
    2. fetch the leading run of hits with one batched get (into a destination buffer);
    3. store the request's blocks that did not exist with one batched put (from a source
       buffer whose block values were stamped, untimed, with the block's hash and the
       trial's nonce).

Batches larger than `max_batch_bytes` are split (both buffers are that large). A request's
latency is the sum of its timed store calls; the stamping and the checks are outside them.
Every fetched block is checked against its stamp as it arrives (untimed), and after the replay
every block stored in the trial is read back and checked (blocks the store evicted, when
capacity is limited, are counted as evicted, not as failures; so is a block that existed at
the exists call and was evicted before its get: `vanished`, a failure only when capacity is
unlimited).

Systems: mooncaked (BlockingClient: batch_exists / batch_get_into / batch_put_from over the
Unix socket), mooncake (batch_is_exist / batch_get_into / batch_put_from, in-process, its own
segment), mooncake-daemon (the same calls as a client of mooncake_client), redis (pipelines of
EXISTS / GET / SET over its Unix socket).
"""

from __future__ import annotations

import json
import time

from common import CpuWindow, check_value, emit, new_nonce, pattern, percentile, stamp_into

pc = time.perf_counter_ns
BLOCK_TOKENS = 512


def load_trace(path: str, requests: int) -> list[dict]:
    out = []
    with open(path) as f:
        for line in f:
            if len(out) >= requests:
                break
            if line.strip():
                r = json.loads(line)
                out.append({"hashes": r["hash_ids"], "tokens": r["input_length"]})
    return out


def block_tokens(request: dict, i: int) -> int:
    """Tokens in block i of a request (the last block may be partial)."""
    return max(0, min(BLOCK_TOKENS, request["tokens"] - i * BLOCK_TOKENS))


def ideal(trace: list[dict]) -> dict:
    """Hit rates if every block ever stored were still there (prefix hits, as replayed)."""
    seen, blocks, hits, tokens, hit_tokens = set(), 0, 0, 0, 0
    for r in trace:
        lead = 0
        for h in r["hashes"]:
            if h not in seen:
                break
            lead += 1
        blocks += len(r["hashes"])
        hits += lead
        tokens += r["tokens"]
        hit_tokens += sum(block_tokens(r, i) for i in range(lead))
        seen.update(r["hashes"])
    return {"blocks": blocks, "unique_blocks": len(seen), "hit_blocks": hits,
            "hit_rate_blocks": hits / blocks if blocks else 0.0, "tokens": tokens,
            "hit_tokens": hit_tokens, "hit_rate_tokens": hit_tokens / tokens if tokens else 0.0}


def role_replay(a: dict) -> None:
    from workers import connect, fill_segment, warm_client_mapping
    system, tag = a["system"], a["tag"]
    size = a["block_bytes"]
    trace = load_trace(a["trace"], a["requests"])
    per_batch = max(1, a["max_batch_bytes"] // size)
    api = connect(a)
    out = {"system": system}
    if system == "mooncake":  # its own fresh segment: first touch, then empty it
        out["cold_fill"] = fill_segment(api, tag, int(a["segment_bytes"] * 0.87))
    elif system == "mooncaked":  # the daemon prefaulted its segment; populate our mapping
        out["mapping"] = warm_client_mapping(api, tag, 1)
    src, dst = api.alloc(per_batch * size), api.alloc(per_batch * size)
    slots_src = [src.address + i * size for i in range(per_batch)]
    slots_dst = [dst.address + i * size for i in range(per_batch)]
    base = pattern(size, size)
    for i in range(per_batch):
        src.view(i * size, size)[:] = base
    nonce = new_nonce()
    key = lambda h: f"{tag}-blk{h}"  # noqa: E731
    # warm-up on keys outside the trace: connection, code paths
    warm = [f"{tag}-warm-{i}" for i in range(min(4, per_batch))]
    api.batch_put_from(warm, slots_src[:len(warm)], [size] * len(warm))
    api.batch_exists(warm)
    api.batch_get_into(warm, slots_dst[:len(warm)], [size] * len(warm))
    emit("READY")

    latencies, stored = [], {}
    counts = {"requests": 0, "blocks": 0, "tokens": 0, "hit_blocks": 0, "hit_tokens": 0,
              "put_blocks": 0, "exists_failed": 0, "get_failed": 0, "put_failed": 0,
              "fetched_bad": 0, "present_not_leading": 0, "vanished": 0}
    with CpuWindow(a.get("server_pids")) as cpu:
        for r in trace:
            keys = [key(h) for h in r["hashes"]]
            ns = 0
            present = []
            for b0 in range(0, len(keys), 1024):  # exists: keys only, any batch size
                t0 = pc(); got = api.batch_exists(keys[b0:b0 + 1024]); ns += pc() - t0
                present += got
            counts["exists_failed"] += sum(1 for x in present if x is None)
            lead = 0
            while lead < len(keys) and present[lead] is True:
                lead += 1
            for b0 in range(0, lead, per_batch):
                chunk = keys[b0:min(lead, b0 + per_batch)]
                t0 = pc()
                oks = api.batch_get_into(chunk, slots_dst[:len(chunk)], [size] * len(chunk))
                ns += pc() - t0
                for i, (k, ok) in enumerate(zip(chunk, oks)):
                    if not ok and api.exists(k) is False:  # evicted since the exists call
                        counts["vanished"] += 1
                    elif not ok:
                        counts["get_failed"] += 1
                    elif not check_value(dst.view(i * size, size), base, size,
                                         r["hashes"][b0 + i], nonce):
                        counts["fetched_bad"] += 1
            missing = [i for i in range(lead, len(keys)) if present[i] is not True]
            counts["present_not_leading"] += len(keys) - lead - len(missing)
            for b0 in range(0, len(missing), per_batch):
                idx = missing[b0:b0 + per_batch]
                for j, i in enumerate(idx):  # untimed: this block's value
                    stamp_into(src.view(j * size, size), r["hashes"][i], nonce)
                chunk = [keys[i] for i in idx]
                t0 = pc()
                oks = api.batch_put_from(chunk, slots_src[:len(chunk)], [size] * len(chunk))
                ns += pc() - t0
                for i, ok in zip(idx, oks):
                    if ok:
                        stored[keys[i]] = r["hashes"][i]
                    else:
                        counts["put_failed"] += 1
            latencies.append(ns)
            counts["requests"] += 1
            counts["blocks"] += len(keys)
            counts["tokens"] += r["tokens"]
            counts["hit_blocks"] += lead
            counts["hit_tokens"] += sum(block_tokens(r, i) for i in range(lead))
            counts["put_blocks"] += len(missing)

    # every block stored in the trial: still there? its bytes?
    evicted = bad = 0
    items = list(stored.items())
    for b0 in range(0, len(items), per_batch):
        chunk = items[b0:b0 + per_batch]
        there = api.batch_exists([k for k, _ in chunk])
        keep = [(k, h) for (k, h), x in zip(chunk, there) if x is True]
        evicted += len(chunk) - len(keep)
        if keep:
            oks = api.batch_get_into([k for k, _ in keep], slots_dst[:len(keep)],
                                     [size] * len(keep))
            for i, ((k, h), ok) in enumerate(zip(keep, oks)):
                if not ok and api.exists(k) is False:  # evicted since the exists call
                    evicted += 1
                    continue
                bad += not (ok and check_value(dst.view(i * size, size), base, size, h, nonce))
    total_s = sum(latencies) / 1e9
    out["wall_s"] = total_s
    ordered = sorted(latencies)
    moved = (counts["hit_blocks"] + counts["put_blocks"]) * size
    out.update(counts)
    out.update({
        "total_s": total_s,
        "requests_s": counts["requests"] / total_s if total_s else None,
        "blocks_s": (counts["hit_blocks"] + counts["put_blocks"]) / total_s if total_s else None,
        "gbps": moved / total_s / 1e9 if total_s else None,
        "bytes_moved": moved,
        "p50_us": percentile(ordered, 50) / 1e3, "p99_us": percentile(ordered, 99) / 1e3,
        "hit_rate_blocks": counts["hit_blocks"] / counts["blocks"] if counts["blocks"] else 0,
        "hit_rate_tokens": counts["hit_tokens"] / counts["tokens"] if counts["tokens"] else 0,
        "server_cpu_s": cpu.server_s, "client_cpu_s": cpu.client_s,
        "verify": {"stored": len(stored), "evicted": evicted, "bad": bad},
        "ideal": ideal(trace),
    })
    api.free(src)
    api.free(dst)
    api.close()
    emit("RESULT", out)


ROLES = {"replay": role_replay}
