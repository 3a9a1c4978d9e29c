"""Worker roles of the ssd section (ssd.py), dispatched by workers.py; mooncaked only, under
the project's Python:

    ssd_offload  put_from `count` stamped values of `size` bytes (more than the DRAM segment
                 holds), then follow the daemon's SSD counters until the offloader is idle:
                 offload write throughput = bytes the tier wrote / the time it was writing.
                 Then get_into up to `reads` values the daemon names as SSD-only (get_replica
                 tier "ssd"), one in flight, timed: the SSD-hit rows. Last, every key written
                 is read back and checked (untimed); one that is gone is a failure (the SSD
                 is sized to hold them all)
    ssd_dram     put_from 4 KiB and 1 MiB values that stay in DRAM, then get 4 KiB and get_into
                 1 MiB of them, timed (the DRAM-hit rows, with and without the tier)
    ssd_hot      put `hot` 4 KiB values, READY; on GO get them round robin for `window_s`
                 (idle), MID; on GO again another `window_s` (while the orchestrator has the
                 daemon offload), RESULT with both windows' p50/p99
"""

from __future__ import annotations

import time

from common import (Buffer, CpuWindow, MiB, check_value, emit, latency_summary, new_nonce,
                    pattern, stamp_into, wait_line)

pc = time.perf_counter_ns


def ssd_counters(client) -> dict:
    """The disk tier's counters from the daemon's status (`tiers`: `ssd` is the tier's own
    block, `offload` the offloader's), flattened to what the rows need."""
    tiers = client.call("status").get("tiers")
    if not tiers:
        raise SystemExit("the daemon reports no disk tier in status(): is [ssd] enabled?")
    ssd, offload = tiers["ssd"], tiers["offload"]
    return {"write_bytes": ssd["write_bytes"], "writes": ssd["writes"],
            "read_bytes": ssd["read_bytes"], "disk_only_objects": ssd["disk_only_objects"],
            "offload_in_flight": offload["in_flight"], "offloads": offload["done"],
            "offload_failed": offload["failed"]}


def _api(a: dict):
    """workers.ClientAPI over the Unix socket: put_from / get_into through shared memory."""
    from workers import connect
    return connect({"system": "mooncaked", "address": a["address"]})


def _tier_of(client, key: str) -> str | None:
    """Where the daemon holds a value ("dram" or "ssd"), from object_stat (which reads
    nothing; get_replica of an SSD-only value would read it)."""
    try:
        return client.call("object_stat", key)["tier"]
    except Exception:  # noqa: BLE001 (gone)
        return None


def _get_into(api, key: str, dst, size: int) -> bool:
    """get_into; False for a value that is gone (the client raises ObjectNotFound)."""
    from mooncaked.errors import ObjectNotFound
    try:
        return api.get_into(key, dst.address, size)
    except ObjectNotFound:
        return False


def role_ssd_offload(a: dict) -> None:
    api = _api(a)
    client = api.c
    size, count, tag = a["size"], a["count"], a["tag"]
    nonce = new_nonce()
    base = pattern(size, size)
    src, dst = Buffer(size, base), Buffer(size)
    emit("READY")
    start_counters = ssd_counters(client)
    put_failed = 0
    t_put0 = time.monotonic()
    for i in range(count):
        src.view()[:] = base
        stamp_into(src.view(), i, nonce)  # (untimed as a whole: this loop is not a latency row)
        put_failed += not api.put_from(f"{tag}-{i}", src.address, size)
    t_put1 = time.monotonic()
    # Follow the tier's bytes written until it has been idle for a second.
    timeline = []
    idle_since, last = None, None
    deadline = time.monotonic() + a.get("drain_timeout_s", 300)
    while time.monotonic() < deadline:
        c = ssd_counters(client)
        now = time.monotonic()
        timeline.append((now, c["write_bytes"]))
        if last is not None and c["write_bytes"] == last and not c.get("offload_in_flight"):
            idle_since = idle_since or now
            if now - idle_since >= 1.0:
                break
        else:
            idle_since = None
        last = c["write_bytes"]
        time.sleep(0.05)
    if not timeline:  # drain_timeout_s 0: the caller only wanted the puts
        timeline.append((time.monotonic(), ssd_counters(client)["write_bytes"]))
    writing = [(t, b) for t, b in timeline if b > start_counters["write_bytes"]]
    first_t = next((t for t, b in timeline if b > start_counters["write_bytes"]), None)
    written = timeline[-1][1] - start_counters["write_bytes"]
    end_t = next((t for t, b in timeline if b == timeline[-1][1]), None)
    # The writing window starts at the put loop's start (the first write may begin before
    # the first poll) and ends at the first poll that saw the final count.
    offload_s = (end_t - t_put0) if writing and end_t else None
    out = {"put_s": t_put1 - t_put0, "put_failed": put_failed, "written_bytes": written,
           "offload_s": offload_s, "first_write_after_s": None if first_t is None
           else first_t - t_put0,
           "offload_mbps": written / offload_s / 1e6 if offload_s else None,
           "counters_start": start_counters, "counters_end": ssd_counters(client)}

    if not a.get("verify", True):  # the p99 trial's load: emit before any read disturbs
        api.close()            # the reader's window (the offload trial checks this path)
        emit("RESULT", out)
        return
    # SSD hits: values the daemon holds on SSD only.
    on_ssd = [i for i in range(count) if _tier_of(client, f"{tag}-{i}") == "ssd"]
    out["ssd_only_keys"] = len(on_ssd)
    reads = on_ssd[:a["reads"]]
    ns, read_failed, bad = [], 0, 0
    with CpuWindow(a.get("server_pids")) as cpu:
        for i in reads:
            t0 = pc()
            ok = _get_into(api, f"{tag}-{i}", dst, size)
            ns.append(pc() - t0)
            if not ok:
                read_failed += 1
            elif not check_value(dst.view(), base, size, i, nonce):
                bad += 1
    out["ssd_hit"] = dict(latency_summary(ns, size), errors=read_failed, bad=bad,
                          server_cpu_s=cpu.server_s, client_cpu_s=cpu.client_s)
    # Every key written, read back (untimed).
    missing = wrong = 0
    for i in range(count):
        if not _get_into(api, f"{tag}-{i}", dst, size):
            missing += 1
        elif not check_value(dst.view(), base, size, i, nonce):
            wrong += 1
    status = client.call("status")
    eviction = ((status.get("tiers") or {}).get("eviction") or {})
    out["verify"] = {"stored": count - put_failed, "missing": missing, "bad": wrong,
                     "evicted_without_offload": eviction.get("without_offload"),
                     "evicted_to_disk": eviction.get("to_disk")}
    api.close()
    emit("RESULT", out)


def role_ssd_dram(a: dict) -> None:
    api = _api(a)
    tag, nonce = a["tag"], new_nonce()
    out = {}
    for size, count, reps in ((4096, a["small_keys"], a["small_gets"]),
                              (MiB, a["big_keys"], a["big_gets"])):
        base = pattern(size, size)
        src, dst = Buffer(size, base), Buffer(size)
        for i in range(count):
            src.view()[:] = base
            stamp_into(src.view(), i, nonce)
            api.put_from(f"{tag}-{size}-{i}", src.address, size)
        ns, failed, bad = [], 0, 0
        with CpuWindow(a.get("server_pids")) as cpu:
            for r in range(reps):
                i = r % count
                t0 = pc()
                ok = api.get(f"{tag}-{size}-{i}") if size == 4096 else \
                    api.get_into(f"{tag}-{size}-{i}", dst.address, size)
                ns.append(pc() - t0)
                got = ok if size == 4096 else (dst.view() if ok else None)
                if not got:
                    failed += 1
                elif not check_value(got, base, size, i, nonce):
                    bad += 1
        out[str(size)] = dict(latency_summary(ns, size), errors=failed, bad=bad,
                              server_cpu_s=cpu.server_s, client_cpu_s=cpu.client_s)
    api.close()
    emit("RESULT", out)


def role_ssd_hot(a: dict) -> None:
    api = _api(a)
    client = api.c
    tag, nonce, hot = a["tag"], new_nonce(), a["hot"]
    base = pattern(4096, 4096)
    value = bytearray(4096)
    for i in range(hot):
        value[:] = base
        stamp_into(memoryview(value), i, nonce)
        client.put(f"{tag}-hot-{i}", bytes(value))
    emit("READY")
    out, failed, bad = {}, 0, 0
    for window in ("idle", "offloading"):
        wait_line("GO")
        written0 = ssd_counters(client)["write_bytes"]
        ns = []
        end = time.monotonic() + a["window_s"]
        i = 0
        while time.monotonic() < end:
            k = i % hot
            t0 = pc()
            got = client.get(f"{tag}-hot-{k}")
            ns.append(pc() - t0)
            failed += got is None
            bad += got is not None and not check_value(got, base, 4096, k, nonce)
            i += 1
        out[window] = dict(latency_summary(ns, 4096),
                           ssd_written_bytes=ssd_counters(client)["write_bytes"] - written0)
        if window == "idle":
            emit("MID")
    out.update(errors=failed, bad=bad)
    api.close()
    emit("RESULT", out)


ROLES = {"ssd_offload": role_ssd_offload, "ssd_dram": role_ssd_dram, "ssd_hot": role_ssd_hot}
