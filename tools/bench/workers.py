"""Worker processes for the store measurements, one fresh process per trial.

    python workers.py ROLE 'JSON-ARGS'

Store roles (this file):
    single   one client, one op in flight: put/get of bytes, put_from/get_into of a buffer at a
             raw address, batch_put_from/batch_get_into; args["system"] picks the store:
               mooncaked         mooncaked.BlockingClient over the Unix socket (shared memory)
               mooncaked-facade  mooncaked.mooncake_store.MooncakeDistributedStore (same socket)
               mooncake          Mooncake Store's client (its own segment, TCP transport)
             (Redis has its own role, redis_single: SET/GET only.)
    rate     small ops for a fixed window after a GO barrier (several processes at once):
             exists, put of 4 KiB, batched exists of `batch` keys (counted in keys)
    prefill  the daemon's status; first touch of its segment unless it prefaulted it
Machine roles (memcpy, sockets, fdatasync) live in machine.py, the cluster section's roles in
cluster_workers.py; both are dispatched from here too.

The same loop measures every system: each system is wrapped in a small adapter whose methods
return plain success flags, so the timing code is shared. The mooncaked roles run under the
project's Python (no numpy there); the Mooncake and Redis roles under the bench venv.
Timing: time.perf_counter_ns() around each call; time.monotonic() for windows compared across
processes.
"""

from __future__ import annotations

import json
import sys
import time

from common import MiB, Buffer, emit, latency_summary, pattern, percentile, wait_line

pc = time.perf_counter_ns


# -- adapters --------------------------------------------------------------------------------

class StoreAPI:
    """Mooncake's MooncakeDistributedStore interface (real Mooncake, or mooncaked's facade)."""

    def __init__(self, store) -> None:
        self.s = store

    def put(self, key, value):
        return self.s.put(key, value) == 0

    def get(self, key):
        return self.s.get(key)

    def put_from(self, key, address, size):
        return self.s.put_from(key, address, size) == 0

    def get_into(self, key, address, size):
        return self.s.get_into(key, address, size) == size

    def batch_put_from(self, keys, addresses, sizes):
        return sum(1 for r in self.s.batch_put_from(keys, addresses, sizes) if r != 0)

    def batch_get_into(self, keys, addresses, sizes):
        return sum(1 for r, n in zip(self.s.batch_get_into(keys, addresses, sizes), sizes)
                   if r != n)

    def exists(self, key):
        return self.s.is_exist(key) == 1

    def batch_exists(self, keys):
        return sum(1 for r in self.s.batch_is_exist(keys) if r != 1)

    def register(self, address, size):
        assert self.s.register_buffer(address, size) == 0

    def unregister(self, address):
        self.s.unregister_buffer(address)

    def clear(self):
        self.s.remove_all(True)

    def close(self):
        self.s.close()


class ClientAPI:
    """mooncaked.BlockingClient: put_from / get_into_address move values through shared memory."""

    def __init__(self, client) -> None:
        self.c = client

    def put(self, key, value):
        return self.c.put(key, value) is True

    def get(self, key):
        return self.c.get(key)

    def put_from(self, key, address, size):
        return self.c.put_from(key, address, size) is True

    def get_into(self, key, address, size):
        return self.c.get_into_address(key, address, size) == size

    def batch_put_from(self, keys, addresses, sizes):
        return sum(1 for r in self.c.batch_put_from(keys, addresses, sizes) if r != 0)

    def batch_get_into(self, keys, addresses, sizes):
        return sum(1 for r, n in zip(self.c.batch_get_into(keys, addresses, sizes), sizes)
                   if r != n)

    def exists(self, key):
        return self.c.exists(key) is True

    def batch_exists(self, keys):
        return sum(1 for r in self.c.batch_exists(keys) if r is not True)

    def register(self, address, size):
        pass  # shared memory needs no registration

    def unregister(self, address):
        pass

    def clear(self):
        self.c.remove_all(True)

    def close(self):
        self.c.close()


def connect(a: dict, segment_bytes: int | None = None, local_buffer_bytes: int | None = None):
    """An adapter for a["system"]; Mooncake gets its own segment of `segment_bytes`."""
    system = a["system"]
    local_buffer = local_buffer_bytes or a.get("local_buffer_bytes", 64 * MiB)
    if system == "mooncaked":
        from mooncaked import BlockingClient
        return ClientAPI(BlockingClient.connect(a["address"], namespace="bench"))
    if system == "mooncaked-facade":
        from mooncaked.mooncake_store import MooncakeDistributedStore
        s = MooncakeDistributedStore()
        rc = s.setup("localhost", "P2PHANDSHAKE", 0, local_buffer, "tcp", "", a["address"],
                     tenant_id="bench")
    elif system == "mooncake":
        from mooncake.store import MooncakeDistributedStore
        s = MooncakeDistributedStore()
        rc = s.setup("127.0.0.1", a["metadata_url"], segment_bytes or a["segment_bytes"],
                     local_buffer, "tcp", "", a["master_addr"])
    else:
        raise SystemExit(f"unknown system {system!r}")
    if rc != 0:
        raise SystemExit(f"{system}: setup failed with {rc}")
    return StoreAPI(s)


def fill_segment(api, tag: str, total_bytes: int, remove: str = "all",
                 through_socket: bool = False) -> dict:
    """Store 16 MiB objects up to total_bytes (first touch of segment memory), then remove
    them: 'all' = remove_all(force), 'own' = only these keys (other clients are live).
    put_from by default; put of bytes when through_socket (mooncaked: the daemon then receives
    into every page itself, so its own mapping is warm too)."""
    chunk = 16 * MiB
    src = Buffer(chunk)
    api.register(src.address, chunk)
    count = max(1, total_bytes // chunk)
    done = 0
    started = time.perf_counter()
    for i in range(count):
        key = f"{tag}-fill-{i}"
        if not (api.put(key, src.data) if through_socket else
                api.put_from(key, src.address, chunk)):
            break
        done += 1
    elapsed = time.perf_counter() - started
    if remove == "all":
        api.clear()
    else:
        for i in range(done):
            api.s.remove(f"{tag}-fill-{i}", True)
    api.unregister(src.address)
    return {"mbps": done * chunk / elapsed / 1e6, "bytes": done * chunk, "complete": done == count}


def mooncaked_client(api):
    """The BlockingClient under a mooncaked adapter (the facade keeps one inside)."""
    return api.c if isinstance(api, ClientAPI) else api.s._client


def wait_drained(client, fraction: float = 0.05, timeout_s: float = 15.0):
    """mooncaked frees a forcibly removed value only when its read lease (10 s) ends: wait
    until the previous trial's values are gone, so that no trial runs into eviction. Returns
    (seconds waited, the daemon's eviction count)."""
    started = time.monotonic()
    while True:
        status = client.status()
        if status["used_bytes"] <= fraction * status["capacity_bytes"] or \
                time.monotonic() - started > timeout_s:
            return time.monotonic() - started, status["evictions"]["objects"]
        time.sleep(0.2)


MADV_POPULATE_WRITE = 23  # Linux 5.14+; not exported by Python 3.11's mmap module


def warm_client_mapping(api, tag: str, cold_ops: int) -> dict:
    """mooncaked only. A fresh client maps the daemon's segments lazily, so its first copy into
    each 4 KiB page takes a page-table fault (the memory itself is already allocated). First
    measure put_from of 16 MiB into that fresh mapping (`cold_ops` values), then populate the
    whole mapping with madvise(MADV_POPULATE_WRITE), outside any timed region, so the rows
    that follow compare warm memory with warm memory (Mooncake's worker fills its own segment
    first). Reaches into the client's private `segments._maps`: a benchmark-only warm-up."""
    client = mooncaked_client(api)
    size = 16 * MiB
    src = Buffer(size)
    api.register(src.address, size)
    cold_ns = []
    for i in range(cold_ops):
        t0 = pc(); api.put_from(f"{tag}-cold-{i}", src.address, size); cold_ns.append(pc() - t0)
    api.unregister(src.address)
    api.clear()
    maps = list(getattr(client.segments, "_maps", {}).values())
    total = sum(len(m) for m in maps)
    started = time.perf_counter()
    try:
        for m in maps:
            m.madvise(MADV_POPULATE_WRITE)
        populated = True
    except OSError:
        populated = False
    elapsed = time.perf_counter() - started
    return {"put_from_cold": latency_summary(cold_ns, size), "populated": populated,
            "populate_bytes": total, "populate_gbps": total / elapsed / 1e9 if populated else None}


# -- roles -----------------------------------------------------------------------------------

def timed(op, items, bytes_per_op: int) -> dict:
    """Time op(item) for each item, one in flight; op returns a true value when it failed."""
    ns, errors = [], 0
    for item in items:
        t0 = pc(); failed = op(item); ns.append(pc() - t0)
        errors += bool(failed)
    return dict(latency_summary(ns, bytes_per_op), errors=errors)


def measure_bytes(put, get, clear, sizes, tag: str, warm_ops: int, out: dict) -> None:
    """put/get of bytes at each size, the same for every system: warm up (small and 16 MiB
    values), then time `put(key, value)` and `get(key)`; `clear()` empties the store between
    sizes. Fills out["bytes"] and out["verified"]."""
    for i in range(warm_ops):  # connection, code paths, staging buffers
        put(f"{tag}-warm-{i}", b"w" * 4096)
        get(f"{tag}-warm-{i}")
    big = b"w" * (16 * MiB)
    for i in range(4):
        put(f"{tag}-warmbig-{i}", big)
        get(f"{tag}-warmbig-{i}")
    del big
    clear()
    for size, nops in sizes:
        value = pattern(size, size)
        keys = [f"{tag}-b{size}-{i}" for i in range(nops)]
        put_timing = timed(lambda k: not put(k, value), keys, size)
        get_timing = timed(lambda k: len(get(k)) != size, keys, size)
        out["verified"] &= get(keys[-1]) == value
        out["bytes"][str(size)] = {"put": put_timing, "get": get_timing}
        clear()


def role_single(a: dict) -> None:
    """One client: bytes put/get, put_from/get_into, batch_put_from/batch_get_into. Each
    summary carries its failed-op count; values are checked outside the timed loops."""
    api = connect(a)
    tag = a["tag"]
    out = {"bytes": {}, "zero_copy": {}, "batch": {}, "verified": True}
    if a["system"] == "mooncake":  # its own fresh segment: touch it once first, as anchors.py
        out["cold_fill"] = fill_segment(api, tag, int(a["segment_bytes"] * 0.87))
    else:  # mooncaked: wait for the previous trial's leased values; warm the fresh mapping
        out["drain_wait_s"], evictions_before = wait_drained(mooncaked_client(api))
        out["mapping"] = warm_client_mapping(api, tag, a["cold_ops"])
    measure_bytes(api.put, api.get, api.clear, a["sizes"], tag, 20, out)

    for size, nops in a["sizes"]:
        src, dst = Buffer(size, pattern(size, size + 1)), Buffer(size)
        api.register(src.address, size)
        api.register(dst.address, size)
        keys = [f"{tag}-z{size}-{i}" for i in range(nops)]
        put = timed(lambda k: not api.put_from(k, src.address, size), keys, size)
        get = timed(lambda k: not api.get_into(k, dst.address, size), keys, size)
        out["verified"] &= dst.data == src.data
        out["zero_copy"][str(size)] = {"put_from": put, "get_into": get}
        api.unregister(src.address)
        api.unregister(dst.address)
        api.clear()

    for size, nkeys, nbatches in a["batches"]:
        total = size * nkeys
        src, dst = Buffer(total, pattern(total, total)), Buffer(total)
        api.register(src.address, total)
        api.register(dst.address, total)
        sources = [src.address + i * size for i in range(nkeys)]
        targets = [dst.address + i * size for i in range(nkeys)]
        sizes = [size] * nkeys
        batches = [[f"{tag}-m{size}-{b}-{i}" for i in range(nkeys)] for b in range(nbatches)]
        put = timed(lambda keys: api.batch_put_from(keys, sources, sizes), batches, total)
        get = timed(lambda keys: api.batch_get_into(keys, targets, sizes), batches, total)
        out["verified"] &= dst.data == src.data
        out["batch"][f"{nkeys}x{size}"] = {"batch_put_from": put, "batch_get_into": get}
        api.unregister(src.address)
        api.unregister(dst.address)
        api.clear()
    if a["system"] != "mooncake":
        out["evictions"] = mooncaked_client(api).status()["evictions"]["objects"] \
            - evictions_before
    api.close()
    emit("RESULT", out)


def _rate_ops(a: dict):
    """(setup-done handle, op(n) -> ok, units counted per op, close) for a rate worker."""
    system, mode, tag = a["system"], a["mode"], a["tag"]
    value = b"r" * 4096
    nkeys, batch = a.get("keys", 256), a.get("batch", 128)  # keys=0: puts only, no set-up
    keys = [f"{tag}-e{i}" for i in range(nkeys)]
    if system == "redis":
        import redis
        r = redis.Redis(host="127.0.0.1", port=a["port"])
        r.ping()
        put, close = r.set, r.close
        exists = lambda key: r.exists(key) == 1

        def batch_exists(names):
            pipe = r.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            return sum(1 for x in pipe.execute() if x != 1)
    else:
        api = connect(a, a.get("segment_bytes"), a.get("local_buffer_bytes"))
        if system == "mooncake":  # touch its own fresh segment; other clients are live
            fill_segment(api, tag, int(a["segment_bytes"] * 0.75), remove="own")
        put, exists, batch_exists, close = api.put, api.exists, api.batch_exists, api.close
    for key in keys:
        put(key, value)
    if mode == "exists":
        return (lambda n: exists(keys[n % nkeys])), 1, close
    if mode == "put":  # a fresh key each time (a put of an existing key is a no-op)
        return (lambda n: bool(put(f"{tag}-p{n}", value))), 1, close
    if mode == "batch_exists":
        groups = [[keys[(g + i) % nkeys] for i in range(batch)] for g in range(0, nkeys, 32)]
        return (lambda n: batch_exists(groups[n % len(groups)]) == 0), batch, close
    raise SystemExit(f"unknown mode {mode!r}")


def role_rate(a: dict) -> None:
    """Small ops for a fixed window; several of these run at once and are summed."""
    op, units, close = _rate_ops(a)
    for n in range(1, 21):  # warm-up on negative indices: the window's puts use fresh keys
        op(-n)
    emit("READY")
    wait_line("GO")
    latencies, n, errors = [], 0, 0
    t_start = time.monotonic()
    deadline = t_start + a["duration_s"]
    while True:
        for _ in range(16):
            t0 = pc(); ok = op(n); latencies.append(pc() - t0)
            errors += not ok
            n += 1
        if time.monotonic() >= deadline:
            break
    t_end = time.monotonic()
    latencies.sort()
    emit("RESULT", {"n": n * units, "calls": n, "t_start": t_start, "t_end": t_end,
                    "errors": errors, "p50_us": percentile(latencies, 50) / 1e3,
                    "p99_us": percentile(latencies, 99) / 1e3})
    wait_line("DONE")
    close()


def role_prefill(a: dict) -> None:
    """Reports the daemon's status (its loop) and, unless the daemon prefaulted its segments
    itself, touches the fresh segment once through the socket (so that the daemon's own mapping
    is warm as well)."""
    from mooncaked import BlockingClient
    client = BlockingClient.connect(a["address"], namespace="bench")
    status = client.status()
    segments = client.server.get("segments", [])
    prefaulted = bool(segments) and all(s.get("prefaulted") for s in segments)
    fill = None
    if not prefaulted:
        capacity = sum(s["size_bytes"] for s in segments)
        fill = fill_segment(ClientAPI(client), "prefill", int(capacity * 0.87),
                            through_socket=True)
    client.close()
    emit("RESULT", {"cold_fill": fill, "prefaulted": prefaulted, "status": status})


def role_redis_single(a: dict) -> None:
    """One redis-py client, SET then GET per value size (no pipelining)."""
    import redis
    r = redis.Redis(host="127.0.0.1", port=a["port"])
    r.ping()
    tag = a["tag"]
    out = {"bytes": {}, "verified": True}
    measure_bytes(r.set, r.get, r.flushall, a["sizes"], tag, 50, out)
    emit("RESULT", out)


ROLES = {"single": role_single, "rate": role_rate, "prefill": role_prefill,
         "redis_single": role_redis_single}

if __name__ == "__main__":
    import cluster_workers
    import machine
    role, args = sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    (ROLES.get(role) or cluster_workers.ROLES.get(role) or machine.ROLES[role])(args)
