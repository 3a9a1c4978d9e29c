"""Worker processes for the store measurements, one fresh process per trial.

    python workers.py ROLE 'JSON-ARGS'

Store roles (this file):
    single   one client, one op in flight: put/get of bytes, put_from/get_into of a buffer at a
             raw address, batch_put_from/batch_get_into; args["system"] picks the store:
               mooncaked         mooncaked.BlockingClient over the Unix socket (shared memory);
               mooncaked+bp      the same, against a daemon with busy_poll_us set
               mooncaked-facade  mooncaked.mooncake_store.MooncakeDistributedStore (same socket)
               mooncake          Mooncake Store's client in-process (its own segment; puts
                                 name it as preferred_segment)
               mooncake-daemon   Mooncake's client of a `mooncake_client` store process
                                 (setup_dummy; buffers from alloc_from_mem_pool)
               redis             redis-py (hiredis) over Redis' Unix socket: bytes rows only
             Every value carries its key's index and the trial's nonce (common.stamped); every
             key is read back and checked after its timed loop. Each row reports the servers'
             CPU seconds (/proc/PID/stat of args["server_pids"]) and the worker's own.
    rate     small ops for a fixed window after a GO barrier (several processes at once):
             exists, put of 4 KiB, batched exists of `batch` keys (counted in keys); only
             successful units count; after DONE every key written is checked (VERIFIED)
    prefill  mooncaked: the daemon's status, first touch of its segment unless it prefaulted
             it; mooncake-daemon: first touch of the mooncake_client's segment
Machine roles (memcpy, sockets, fdatasync) live in machine.py, the cluster section's roles in
cluster_workers.py, the trace replay in replay_worker.py, the TLS section's in tls_worker.py;
all are dispatched from here too.

The same loop measures every system: each system is wrapped in a small adapter whose methods
return plain success flags, so the timing code is shared. The mooncaked roles run under the
project's Python (no numpy there); the Mooncake and Redis roles under the bench venv.
Timing: time.perf_counter_ns() around each call; time.monotonic() for windows compared across
processes.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

from common import (STAMP, MiB, Buffer, CpuWindow, check_value, emit, latency_summary, new_nonce,
                    pattern, percentile, stamp_into, stamped, wait_line)

pc = time.perf_counter_ns
cpu_now = time.process_time


# -- adapters --------------------------------------------------------------------------------
# Every adapter answers: put/put_from/get_into -> bool (stored / filled), get -> bytes or None,
# exists -> True/False (None = the call failed), batch_* -> one bool per key (batch_exists:
# True/False/None per key), alloc(size) -> a Buffer the store can move bytes in and out of.

class StoreAPI:
    """Mooncake's MooncakeDistributedStore interface: real Mooncake in-process (its own
    segment), real Mooncake as a client of a `mooncake_client` daemon (setup_dummy), or
    mooncaked's facade. `config`: the ReplicateConfig every put passes (Mooncake in-process:
    preferred_segment = this client's own segment)."""

    def __init__(self, store, config=None, pool: bool = False) -> None:
        self.s = store
        self.config = config
        self.pool = pool  # buffers must come from alloc_from_mem_pool (setup_dummy)
        self.kw = {} if config is None else {"config": config}

    def put(self, key, value):
        return self.s.put(key, value, **self.kw) == 0

    def get(self, key):
        value = self.s.get(key)
        return value if value else None

    def put_from(self, key, address, size):
        return self.s.put_from(key, address, size, **self.kw) == 0

    def get_into(self, key, address, size):
        return self.s.get_into(key, address, size) == size

    def batch_put_from(self, keys, addresses, sizes):
        return [r == 0 for r in self.s.batch_put_from(keys, addresses, sizes, **self.kw)]

    def batch_get_into(self, keys, addresses, sizes):
        return [r == n for r, n in zip(self.s.batch_get_into(keys, addresses, sizes), sizes)]

    def exists(self, key):
        r = self.s.is_exist(key)
        return None if r < 0 else r == 1

    def batch_exists(self, keys):
        return [None if r < 0 else r == 1 for r in self.s.batch_is_exist(keys)]

    def alloc(self, size, fill=None):
        address = None
        if self.pool:
            address = self.s.alloc_from_mem_pool(size)
            if not address:
                raise SystemExit(f"alloc_from_mem_pool({size}) failed")
        buf = Buffer(size, fill, address)
        assert self.s.register_buffer(buf.address, size) == 0
        return buf

    def free(self, buf):
        self.s.unregister_buffer(buf.address)

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
        return [r == 0 for r in self.c.batch_put_from(keys, addresses, sizes)]

    def batch_get_into(self, keys, addresses, sizes):
        return [r == n for r, n in zip(self.c.batch_get_into(keys, addresses, sizes), sizes)]

    def exists(self, key):
        return self.c.exists(key) is True

    def batch_exists(self, keys):
        return [r is True for r in self.c.batch_exists(keys)]

    def batch_put(self, keys, values):
        """The values through the socket in one request (batch_put: one log entry per batch
        on a cluster node); per key True when stored."""
        return [r == 0 for r in self.c.batch_put(keys, values)]

    def alloc(self, size, fill=None):
        return Buffer(size, fill)  # shared memory needs no registration

    def free(self, buf):
        pass

    def clear(self):
        self.c.remove_all(True)

    def close(self):
        self.c.close()


class RedisAPI:
    """redis-py (with hiredis when installed) over Redis' Unix socket. Batches are pipelines
    (transaction=False); batch_put_from sends views of the caller's buffer (no copy in
    Python), batch_get_into copies each GET reply into the caller's buffer (inside the timed
    call: the bytes must land there, as with the other stores)."""

    def __init__(self, a: dict) -> None:
        import redis
        if a.get("unix_socket"):
            self.r = redis.Redis(unix_socket_path=a["unix_socket"])
        else:
            self.r = redis.Redis(host="127.0.0.1", port=a["port"])
        self.r.ping()

    def put(self, key, value):
        return self.r.set(key, value) is True

    def get(self, key):
        return self.r.get(key)

    @staticmethod
    def _view(address, size):
        return memoryview((ctypes.c_char * size).from_address(address)).cast("B")

    def batch_put_from(self, keys, addresses, sizes):
        pipe = self.r.pipeline(transaction=False)
        for key, address, size in zip(keys, addresses, sizes):
            pipe.set(key, self._view(address, size))
        return [r is True for r in pipe.execute(raise_on_error=False)]

    def batch_get_into(self, keys, addresses, sizes):
        pipe = self.r.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        out = []
        for value, address, size in zip(pipe.execute(raise_on_error=False), addresses, sizes):
            ok = isinstance(value, bytes) and len(value) == size
            if ok:
                ctypes.memmove(address, value, size)
            out.append(ok)
        return out

    def exists(self, key):
        return self.r.exists(key) == 1

    def batch_exists(self, keys):
        pipe = self.r.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return [None if isinstance(x, Exception) else x == 1
                for x in pipe.execute(raise_on_error=False)]

    def alloc(self, size, fill=None):
        return Buffer(size, fill)

    def free(self, buf):
        pass

    def clear(self):
        self.r.flushall()

    def close(self):
        self.r.close()


def connect(a: dict, segment_bytes: int | None = None, local_buffer_bytes: int | None = None):
    """An adapter for a["system"]; Mooncake in-process gets its own segment of
    `segment_bytes` and puts with preferred_segment = that segment."""
    system = a["system"]
    local_buffer = local_buffer_bytes or a.get("local_buffer_bytes", 64 * MiB)
    if system in ("mooncaked", "mooncaked+bp"):
        from mooncaked import BlockingClient
        return ClientAPI(BlockingClient.connect(a["address"], namespace="bench"))
    if system == "redis":
        return RedisAPI(a)
    if system == "mooncaked-facade":
        from mooncaked.mooncake_store import MooncakeDistributedStore
        s = MooncakeDistributedStore()
        rc = s.setup("localhost", "P2PHANDSHAKE", 0, local_buffer, "tcp", "", a["address"],
                     tenant_id="bench")
        config, pool = None, False
    elif system == "mooncake":
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        s = MooncakeDistributedStore()
        segment = a["segment_bytes"] if segment_bytes is None else segment_bytes
        if a.get("ssd_offload_path"):  # the ssd section: Mooncake's SSD offload
            rc = s.setup("127.0.0.1", a["metadata_url"], segment, local_buffer, "tcp", "",
                         a["master_addr"], enable_ssd_offload=True,
                         ssd_offload_path=a["ssd_offload_path"])
        else:
            rc = s.setup("127.0.0.1", a["metadata_url"], segment, local_buffer, "tcp", "",
                         a["master_addr"])
        config, pool = None, False
        if rc == 0 and segment:
            # With several clients, Mooncake places a replica in any client's segment (then
            # the bytes cross processes over TCP); this client puts into its own segment.
            config = ReplicateConfig()
            config.preferred_segment = s.get_hostname()
    elif system == "mooncake-daemon":
        from mooncake.store import MooncakeDistributedStore
        s = MooncakeDistributedStore()
        rc = s.setup_dummy(a.get("mem_pool_bytes", 512 * MiB), local_buffer, a["client_addr"])
        config, pool = None, True
    else:
        raise SystemExit(f"unknown system {system!r}")
    if rc != 0:
        raise SystemExit(f"{system}: setup failed with {rc}")
    return StoreAPI(s, config, pool)


def fill_segment(api, tag: str, total_bytes: int, remove: str = "all",
                 through_socket: bool = False) -> dict:
    """Store 16 MiB objects up to total_bytes (first touch of segment memory), then remove
    them: 'all' = remove_all(force), 'own' = only these keys (other clients are live).
    put_from by default; put of bytes when through_socket (mooncaked: the daemon then receives
    into every page itself, so its own mapping is warm too)."""
    chunk = 16 * MiB
    src = api.alloc(chunk)
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
    api.free(src)
    return {"mbps": done * chunk / elapsed / 1e6, "bytes": done * chunk, "complete": done == count}


def mooncaked_client(api):
    """The client under a mooncaked adapter (the facade keeps a pool inside)."""
    return api.c if isinstance(api, ClientAPI) else api.s._client


def mooncaked_status(client) -> dict:
    return client.status() if hasattr(client, "status") else client.call("status")


def wait_drained(client, fraction: float = 0.05, timeout_s: float = 15.0):
    """mooncaked frees a forcibly removed value only when its read lease (10 s) ends: wait
    until the previous trial's values are gone, so that no trial runs into eviction. Returns
    (seconds waited, the daemon's eviction count)."""
    started = time.monotonic()
    while True:
        status = mooncaked_status(client)
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
    src = api.alloc(size)
    cold_ns = []
    for i in range(cold_ops):
        t0 = pc(); api.put_from(f"{tag}-cold-{i}", src.address, size); cold_ns.append(pc() - t0)
    api.free(src)
    api.clear()
    maps = list(getattr(getattr(client, "segments", None), "_maps", {}).values())
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

def timed(op, n: int, bytes_per_op: int, pids, prep=None) -> dict:
    """Time op(i) for i in range(n), one in flight; op returns a true value when it succeeded.
    prep(i) runs first, untimed (writing the value's stamps). The summary carries the failed
    ops, the servers' CPU seconds over the loop and this process's CPU seconds inside the
    timed calls only."""
    ns, errors, client_cpu = [], 0, 0.0
    with CpuWindow(pids) as w:
        for i in range(n):
            arg = prep(i) if prep is not None else None
            c0 = cpu_now()
            t0 = pc(); ok = op(i, arg); t1 = pc()
            client_cpu += cpu_now() - c0
            ns.append(t1 - t0)
            errors += not ok
    return dict(latency_summary(ns, bytes_per_op), errors=errors, ops=n,
                server_cpu_s=w.server_s, client_cpu_s=client_cpu)


def warm_up(api, tag: str, warm_ops: int) -> None:
    """Connection, code paths, staging buffers: small and 16 MiB values, then clear."""
    for i in range(warm_ops):
        api.put(f"{tag}-warm-{i}", b"w" * 4096)
        api.get(f"{tag}-warm-{i}")
    big = b"w" * (16 * MiB)
    for i in range(4):
        api.put(f"{tag}-warmbig-{i}", big)
        api.get(f"{tag}-warmbig-{i}")
    del big
    api.clear()


def measure_bytes(api, a: dict, tag: str, nonce: int, out: dict) -> None:
    """put/get of bytes at each size: each key's value carries its index and the trial's nonce;
    after the timed puts and gets, every key is read again and checked (untimed)."""
    pids = a.get("server_pids")
    for size, nops in a["sizes"]:
        base = pattern(size, size)
        keys = [f"{tag}-b{size}-{i}" for i in range(nops)]
        put = timed(lambda i, v: api.put(keys[i], v), nops, size, pids,
                    prep=lambda i: bytes(stamped(base, size, i, nonce)))

        def get(i, _):
            value = api.get(keys[i])
            return value is not None and len(value) == size
        got = timed(get, nops, size, pids)
        bad = sum(not check_value(api.get(k), base, size, i, nonce) for i, k in enumerate(keys))
        out["bytes"][str(size)] = {"put": put, "get": got, "checked": nops, "bad": bad}
        api.clear()


def measure_zero_copy(api, a: dict, tag: str, nonce: int, out: dict) -> None:
    """put_from one source buffer (stamped for each key, untimed), get_into one destination
    buffer; then every key is read again into the destination and checked."""
    pids = a.get("server_pids")
    for size, nops in a["sizes"]:
        base = pattern(size, size + 1)
        src, dst = api.alloc(size, base), api.alloc(size)
        keys = [f"{tag}-z{size}-{i}" for i in range(nops)]
        view = src.view()
        put = timed(lambda i, _: api.put_from(keys[i], src.address, size), nops, size, pids,
                    prep=lambda i: stamp_into(view, i, nonce))
        got = timed(lambda i, _: api.get_into(keys[i], dst.address, size), nops, size, pids)
        bad = 0
        for i, k in enumerate(keys):
            ok = api.get_into(k, dst.address, size)
            bad += not (ok and check_value(dst.view(), base, size, i, nonce))
        out["zero_copy"][str(size)] = {"put_from": put, "get_into": got, "checked": nops,
                                       "bad": bad}
        api.free(src)
        api.free(dst)
        api.clear()


def measure_batches(api, a: dict, tag: str, nonce: int, out: dict) -> None:
    pids = a.get("server_pids")
    for size, nkeys, nbatches in a["batches"]:
        total = size * nkeys
        base = pattern(size, size + 2)
        src, dst = api.alloc(total), api.alloc(total)
        sources = [src.address + i * size for i in range(nkeys)]
        targets = [dst.address + i * size for i in range(nkeys)]
        sizes = [size] * nkeys
        batches = [[f"{tag}-m{size}-{b}-{i}" for i in range(nkeys)] for b in range(nbatches)]

        def prep(b):
            for i in range(nkeys):
                view = src.view(i * size, size)
                view[:] = base
                stamp_into(view, b * nkeys + i, nonce)
        failed = {"put": 0, "get": 0}

        def batch_op(kind, call, b):
            oks = call(batches[b], sources if kind == "put" else targets, sizes)
            failed[kind] += sum(1 for ok in oks if not ok)
            return True
        put = timed(lambda b, _: batch_op("put", api.batch_put_from, b), nbatches, total, pids,
                    prep=prep)
        got = timed(lambda b, _: batch_op("get", api.batch_get_into, b), nbatches, total, pids)
        put["errors"], got["errors"] = failed["put"], failed["get"]  # failed keys
        bad = 0
        for b, keys in enumerate(batches):
            oks = api.batch_get_into(keys, targets, sizes)
            for i, ok in enumerate(oks):
                bad += not (ok and check_value(dst.view(i * size, size), base, size,
                                               b * nkeys + i, nonce))
        out["batch"][f"{nkeys}x{size}"] = {"batch_put_from": put, "batch_get_into": got,
                                           "checked": nkeys * nbatches, "bad": bad}
        api.free(src)
        api.free(dst)
        api.clear()


def role_single(a: dict) -> None:
    """One client: bytes put/get, put_from/get_into, batch_put_from/batch_get_into (Redis:
    bytes only). Each summary carries its failed-op count and CPU; every key is read back and
    checked outside the timed loops."""
    system = a["system"]
    api = connect(a)
    tag, nonce = a["tag"], new_nonce()
    out = {"bytes": {}, "zero_copy": {}, "batch": {}, "nonce": nonce}
    mooncaked = system.startswith("mooncaked")
    if system == "mooncake":  # its own fresh segment: touch it once first, as anchors.py
        out["cold_fill"] = fill_segment(api, tag, int(a["segment_bytes"] * 0.87))
    elif mooncaked:  # wait for the previous trial's leased values; warm the fresh mapping
        out["drain_wait_s"], evictions_before = wait_drained(mooncaked_client(api))
        out["mapping"] = warm_client_mapping(api, tag, a["cold_ops"])
    warm_up(api, tag, 50 if system == "redis" else 20)
    measure_bytes(api, a, tag, nonce, out)
    if system != "redis":
        measure_zero_copy(api, a, tag, nonce, out)
        measure_batches(api, a, tag, nonce, out)
    if mooncaked:
        out["evictions"] = mooncaked_status(mooncaked_client(api))["evictions"]["objects"] \
            - evictions_before
    api.close()
    emit("RESULT", out)


RATE_VALUE = 4096


def _rate_ops(a: dict, nonce: int):
    """(op(n) -> units that succeeded, units per op, written: {key: index}, api) for a rate
    worker. Values carry their index and the nonce (built in the loop, the same for every
    system: a 16-byte header at both ends of a fixed 4 KiB body)."""
    system, mode, tag = a["system"], a["mode"], a["tag"]
    base = pattern(RATE_VALUE, 4096)
    nkeys, batch = a.get("keys", 256), a.get("batch", 128)  # keys=0: puts only, no set-up
    keys = [f"{tag}-e{i}" for i in range(nkeys)]
    api = connect(a, a.get("segment_bytes"), a.get("local_buffer_bytes"))
    if system == "mooncake":  # touch its own fresh segment; other clients are live
        fill_segment(api, tag, int(a["segment_bytes"] * 0.75), remove="own")
    written = {}
    for i, key in enumerate(keys):
        if api.put(key, bytes(stamped(base, RATE_VALUE, i, nonce))):
            written[key] = i
    middle = base[16:RATE_VALUE - 16]
    pack = STAMP.pack
    if mode == "exists":
        return (lambda n: api.exists(keys[n % nkeys]) is True), 1, written, api
    if mode == "put":  # a fresh key each time (a put of an existing key is a no-op)
        def put(n):
            key, tag_bytes = f"{tag}-p{n}", pack(nonce, n)
            if api.put(key, tag_bytes + middle + tag_bytes):
                written[key] = n
                return True
            return False
        return put, 1, written, api
    if mode == "batch_put":  # `batch` fresh keys of 4 KiB per call
        return _batch_put_op(api, system, tag, batch, middle, pack, nonce, written), batch, \
            written, api
    if mode == "batch_exists":
        groups = [[keys[(g + i) % nkeys] for i in range(batch)] for g in range(0, nkeys, 32)]
        return (lambda n: sum(1 for x in api.batch_exists(groups[n % len(groups)])
                              if x is True)), batch, written, api
    raise SystemExit(f"unknown mode {mode!r}")


def _batch_put_op(api, system: str, tag: str, batch: int, middle: bytes, pack, nonce: int,
                  written: dict):
    """op(n) for mode batch_put: keys n*batch .. n*batch+batch-1, each value stamped with its
    index. mooncaked: batch_put of the values (bytes built in the call, as the put mode's);
    Mooncake: batch_put_from of a registered buffer whose stamps are written in the call (the
    4 KiB bodies are written once, outside)."""
    size = RATE_VALUE
    if system == "mooncake":
        buf = api.alloc(batch * size)
        view = buf.view()
        for i in range(batch):
            view[i * size + 16:(i + 1) * size - 16] = middle
        addresses = [buf.address + i * size for i in range(batch)]
        sizes = [size] * batch

        def put(n):
            first = n * batch
            keys = [f"{tag}-b{first + i}" for i in range(batch)]
            for i in range(batch):
                stamp = pack(nonce, first + i)
                view[i * size:i * size + 16] = stamp
                view[(i + 1) * size - 16:(i + 1) * size] = stamp
            stored = api.batch_put_from(keys, addresses, sizes)
            for i, ok in enumerate(stored):
                if ok:
                    written[keys[i]] = first + i
            return sum(stored)
        return put

    def put(n):
        first = n * batch
        keys = [f"{tag}-b{first + i}" for i in range(batch)]
        values = []
        for i in range(batch):
            stamp = pack(nonce, first + i)
            values.append(stamp + middle + stamp)
        stored = api.batch_put(keys, values)
        for i, ok in enumerate(stored):
            if ok:
                written[keys[i]] = first + i
        return sum(stored)
    return put


def role_rate(a: dict) -> None:
    """Small ops for a fixed window; several of these run at once and are summed. Only the
    units that succeeded count; the failed ones are reported. After DONE, every key this
    worker wrote is read back and checked (VERIFIED)."""
    nonce = new_nonce()
    op, units, written, api = _rate_ops(a, nonce)
    if a["mode"] in ("put", "batch_put"):  # warm keys of their own: the loop's are fresh
        warm = [f"{a['tag']}-w{i}" for i in range(20)]
        for key in warm:
            api.put(key, b"w" * RATE_VALUE)
    else:
        for n in range(20):
            op(n)
    emit("READY")
    wait_line("GO")
    latencies, n, ok_units, failed = [], 0, 0, 0
    c_start = cpu_now()
    t_start = time.monotonic()
    deadline = t_start + a["duration_s"]
    while True:
        for _ in range(16):
            t0 = pc(); got = op(n); latencies.append(pc() - t0)
            got = int(got)
            ok_units += got
            failed += units - got
            n += 1
        if time.monotonic() >= deadline:
            break
    t_end = time.monotonic()
    client_cpu = cpu_now() - c_start
    latencies.sort()
    emit("RESULT", {"n": ok_units, "calls": n, "t_start": t_start, "t_end": t_end,
                    "client_cpu_s": client_cpu,
                    "errors": failed, "p50_us": percentile(latencies, 50) / 1e3,
                    "p99_us": percentile(latencies, 99) / 1e3})
    wait_line("DONE")
    base = pattern(RATE_VALUE, 4096)
    bad = sum(not check_value(api.get(key), base, RATE_VALUE, index, nonce)
              for key, index in written.items())
    emit("VERIFIED", {"checked": len(written), "bad": bad})
    api.close()


def role_prefill(a: dict) -> None:
    """mooncaked: reports the daemon's status (its loop) and, unless the daemon prefaulted its
    segments itself, touches the fresh segment once through the socket (so that the daemon's own
    mapping is warm as well). mooncake-daemon: fills the mooncake_client's segment once."""
    if a.get("system") == "mooncake-daemon":
        api = connect(a)
        fill = fill_segment(api, "prefill", int(a["segment_bytes"] * 0.87))
        api.close()
        emit("RESULT", {"cold_fill": fill})
        return
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


ROLES = {"single": role_single, "rate": role_rate, "prefill": role_prefill}

if __name__ == "__main__":
    import cluster_workers
    import machine
    import replay_worker
    import ssd_worker
    import tls_worker
    role, args = sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    (ROLES.get(role) or cluster_workers.ROLES.get(role) or replay_worker.ROLES.get(role)
     or tls_worker.ROLES.get(role) or ssd_worker.ROLES.get(role) or machine.ROLES[role])(args)
