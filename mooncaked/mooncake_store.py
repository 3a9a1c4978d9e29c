"""Mooncake Store's Python API (`mooncake.store`) over mooncaked, so an engine switches by
changing an import:

    from mooncaked.mooncake_store import MooncakeDistributedStore, ReplicateConfig

Every public name of `mooncake.store` 0.3.13 is here, with Mooncake's method names,
positional and keyword arguments, defaults, return values and error codes (ints are 0 or a
negative Mooncake ErrorCode; `get` of a missing key is b""; `is_exist` 1 / 0; reads return
bytes read). The API-surface test checks the names and signatures against a list taken from
the real wheel (tests/data/mooncake_store_api.json).

How it maps onto mooncaked:
- `setup` / `setup_dummy` / `init_all` connect to the local daemon (a ClientPool: thread-safe,
  reconnects after a daemon restart) instead of joining a cluster as a memory provider: the
  daemon owns the memory, so `global_segment_size` is checked and otherwise ignored, as are
  RDMA, metadata-server, SSD-offload and client-HTTP arguments. The daemon is found at
  `master_server_addr` (`unix:PATH`, `/PATH` or `HOST:PORT`) unless $MOONCAKED_ADDRESS names
  another address; `tenant_id` selects the mooncaked namespace.
- Zero-copy calls (`*_from`, `*_into`, multi-buffer forms) take any non-null address, as
  Mooncake's TCP transport does; `register_buffer` is bookkeeping (`get_into_ranges` needs a
  registered buffer, as in Mooncake). Over the Unix socket the copy is one memcpy to or from
  the daemon's shared memory.
- Before setup and after close every call answers Mooncake's "client not initialized" code
  (INVALID_PARAMS, -600, or None / b"" where Mooncake returns those) instead of crashing; a
  call whose connection broke answers RPC_FAIL (-900): a mutation may or may not have taken
  effect. The next call reconnects.
- Tensor calls store Mooncake's object layout (mooncaked/mooncake_tensor.py) and import
  torch lazily. Calls that cannot mean the same thing here (segment mounting, copy/move
  tasks, NoF/disk replicas) answer NOT_SUPPORTED (-1012) or Mooncake's failure value.
  README.md, "Mooncake API differences", lists every difference.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
from typing import Callable, Sequence

from mooncaked.client import calls
from mooncaked.client.pool import ClientPool
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked import mooncake_tensor as tensors
from mooncaked.mooncake_tensor import METADATA_SIZE
from mooncaked.mooncake_types import (
    BufferHandle, BufferLease, BufferLeaseView, BufferPool, Descriptor, DiskDescriptor,
    EngramStore, EngramStoreConfig, MemoryDescriptor, MooncakeDistributedNoFRegister,
    MooncakeHostMemAllocator, ObjectDataType, ParallelAxis, QueryTaskResponse, ReadTarget,
    RegisteredBufferLease, RegisteredBufferLeaseView, RegisteredBufferPool, ReplicaDescriptor,
    ReplicaStatus, ReplicateConfig, SoftPinAction, TaskStatus, TaskType, TensorParallelism,
    _AnonymousMemory, _get_pyclient_from_wrapper, bind_to_numa_node, get_alloc_func_addr,
    get_free_func_addr)

OK = 0
INVALID = int(ErrorCode.INVALID_PARAMS)  # also Mooncake's answer before setup / after close
NOT_FOUND = int(ErrorCode.OBJECT_NOT_FOUND)
ALREADY_EXISTS = int(ErrorCode.OBJECT_ALREADY_EXISTS)
RPC_FAIL = int(ErrorCode.RPC_FAIL)
TRANSFER_FAIL = int(ErrorCode.TRANSFER_FAIL)
NOT_SUPPORTED = int(ErrorCode.NOT_SUPPORTED)
NOT_INITIALIZED = INVALID

DEFAULT_MASTER_ADDRESS = "127.0.0.1:50051"
DEFAULT_SEGMENT_SIZE = 16 << 20  # Mooncake's DEFAULT_GLOBAL_SEGMENT_SIZE / LOCAL_BUFFER_SIZE
MIN_SEGMENT_SIZE = 1024  # Mooncake: a size is 0 or at least 1 KiB, at most 1 TiB
MAX_SEGMENT_SIZE = 1 << 40
CLIENT_PORT_RANGE = (12300, 14300)  # Mooncake's MC_STORE_CLIENT_MIN_PORT / MAX_PORT defaults
# A daemon that stops answering fails the call (RPC_FAIL) after this long without progress.
CLIENT_TIMEOUT_S = 30.0

# Module-level enum values, as Mooncake's export_values() leaves them (later enums win).
UNKNOWN, KVCACHE, TENSOR, WEIGHT, SAMPLE, ACTIVATION, GRADIENT, OPTIMIZER_STATE, METADATA, \
    GENERAL = ObjectDataType
UNDEFINED, INITIALIZED, _, COMPLETE, REMOVED, _ = ReplicaStatus
REPLICA_COPY, REPLICA_MOVE = TaskType
PENDING, PROCESSING, FAILED, SUCCESS = TaskStatus
del _


def _mooncake_code(code: int) -> int:
    """mooncaked's own codes (-3000 range) as the Mooncake code a caller can act on: the
    request failed in transport, or its outcome is unknown (RPC_FAIL)."""
    return RPC_FAIL if code <= -3000 else int(code)


def _parse_size(value) -> int | None:
    """Mooncake's size strings: an int, "16777216", "16MB", "16 mb", "1.5 GB"; None if not."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    text = str(value).strip().upper().replace(" ", "")
    for unit, factor in (("TB", 1 << 40), ("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10),
                         ("B", 1)):
        if text.endswith(unit):
            number = text[:-len(unit)]
            if number.replace(".", "", 1).isdigit():
                return int(float(number) * factor)
            return None
    return int(text) if text.isdigit() else None


def _parse_bool(value, default: bool) -> bool:
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    return default


def _has_port(hostname: str) -> bool:
    host, sep, port = hostname.rpartition(":")
    return bool(sep) and port.isdigit() and (not host.count(":") or host.endswith("]"))


def _bind_client_port(host: str) -> tuple[socket.socket, int] | None:
    """Hold a port from Mooncake's client range, as Mooncake's client does for its
    `host:port` name, so two stores on one host get different names."""
    low, high = CLIENT_PORT_RANGE
    start = low + (os.getpid() * 7919) % (high - low)
    for step in range(high - low):
        port = low + (start - low + step) % (high - low)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("0.0.0.0", port))
            return sock, port
        except OSError:
            sock.close()
    return None


def _stored(_created: bool) -> int:
    """A put of a key that already exists succeeds in Mooncake (the value is kept)."""
    return OK


def _first_of_each(keys: Sequence[str]) -> list[int]:
    """The indexes of each key's first occurrence, in order."""
    seen: dict[str, int] = {}
    for i, key in enumerate(keys):
        seen.setdefault(key, i)
    return sorted(seen.values())


def _last_of_each(keys: Sequence[str]) -> list[int]:
    """The indexes of each key's last occurrence, in order."""
    return sorted({key: i for i, key in enumerate(keys)}.values())


def _copy(destination: int, source: int, size: int) -> None:
    if size > 0:
        ctypes.memmove(destination, source, size)


class _Failure(Exception):
    """A per-call failure carrying the Mooncake code to return."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class MooncakeDistributedStore:
    """Mooncake's MooncakeDistributedStore. Thread-safe: one object may serve many threads."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # guards the fields below, not the calls
        self._client: ClientPool | None = None
        self._hostname = ""
        self._port_holder: socket.socket | None = None
        self._local_buffer_size = 0
        self._buffers: dict[int, int] = {}  # registered buffer start -> size in bytes
        self._pool_memory: dict[int, _AnonymousMemory] = {}  # alloc_from_mem_pool regions
        self._put_sessions: dict[str, tuple[bytearray, ReplicateConfig]] = {}
        self._get_sessions: set[str] = set()

    # -- set-up and teardown ----------------------------------------------------------------

    def setup(self, local_hostname, metadata_server: str = None,
              global_segment_size: int = None, local_buffer_size: int = None,
              protocol: str = None, rdma_devices: str = None, master_server_addr: str = None,
              engine=None, enable_ssd_offload: bool = False, ssd_offload_path: str = "",
              tenant_id: str = "default", enable_client_http_server: bool = False,
              client_http_port: int = 9300, **options) -> int:
        """setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
        protocol, rdma_devices, master_server_addr, engine=None, enable_ssd_offload=False,
        ssd_offload_path='', tenant_id='default', enable_client_http_server=False,
        client_http_port=9300) -> int, or setup(config: dict) -> int."""
        if isinstance(local_hostname, dict):
            return self._setup_from_dict(local_hostname, **options)
        if None in (metadata_server, global_segment_size, local_buffer_size, protocol,
                    rdma_devices, master_server_addr):
            raise TypeError("setup(): takes local_hostname, metadata_server, "
                            "global_segment_size, local_buffer_size, protocol, rdma_devices, "
                            "master_server_addr (then optional ones), or one dict")
        for size in (global_segment_size, local_buffer_size):
            if not isinstance(size, int) or size < 0:
                raise TypeError("setup(): segment and buffer sizes must be ints >= 0")
        if not local_hostname:
            return INVALID
        if ((global_segment_size and global_segment_size < MIN_SEGMENT_SIZE)
                or (local_buffer_size and local_buffer_size < MIN_SEGMENT_SIZE)
                or local_buffer_size > MAX_SEGMENT_SIZE):
            return INVALID
        address = (os.environ.get("MOONCAKED_ADDRESS") or options.get("mooncaked_address")
                   or master_server_addr or DEFAULT_MASTER_ADDRESS)
        return self._connect(str(local_hostname), address, tenant_id or "default",
                             local_buffer_size)

    def _setup_from_dict(self, config: dict, **options) -> int:
        """Mooncake's dict form: values may be strings ("16MB", "true"); a bad value is
        INVALID_PARAMS, like Mooncake's setup_internal."""
        settings = {str(k): v for k, v in config.items()}
        if not settings.get("local_hostname") or not settings.get("metadata_server"):
            return INVALID
        global_size = _parse_size(settings.get("global_segment_size", DEFAULT_SEGMENT_SIZE))
        buffer_size = _parse_size(settings.get("local_buffer_size", DEFAULT_SEGMENT_SIZE))
        if global_size is None or buffer_size is None:
            return INVALID
        port = str(settings.get("client_http_port", 9300)).strip()
        if not port.lstrip("-").isdigit():
            return INVALID
        _parse_bool(settings.get("enable_ssd_offload", False), False)
        _parse_bool(settings.get("enable_client_http_server", False), False)
        return self.setup(
            str(settings["local_hostname"]), str(settings["metadata_server"]), global_size,
            buffer_size, str(settings.get("protocol", "tcp")),
            str(settings.get("rdma_devices", settings.get("device_name", ""))),
            str(settings.get("master_server_addr",
                             settings.get("master_server_address", DEFAULT_MASTER_ADDRESS))),
            tenant_id=str(settings.get("tenant_id", "default")), **options)

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int,
                    server_address: str) -> int:
        """Mooncake's dummy client talks to a store process on this host: that is mooncaked.
        `server_address` names the daemon; mem_pool_size is the daemon's business."""
        address = os.environ.get("MOONCAKED_ADDRESS") or server_address
        return self._connect("localhost", address, "default", local_buffer_size)

    def init_all(self, protocol: str, device_name: str,
                 mount_segment_size: int = DEFAULT_SEGMENT_SIZE) -> int:
        """Mooncake's all-defaults setup (localhost:12345, master 127.0.0.1:50051, 1 GiB
        local buffer); fails if already set up, as in Mooncake."""
        with self._lock:
            if self._client is not None:
                return INVALID
        address = os.environ.get("MOONCAKED_ADDRESS") or DEFAULT_MASTER_ADDRESS
        return self._connect("localhost:12345", address, "default", 1 << 30)

    def _connect(self, local_hostname: str, address: str, namespace: str,
                 local_buffer_size: int) -> int:
        port_holder = None
        hostname = local_hostname
        if not _has_port(local_hostname):
            bound = _bind_client_port(local_hostname)
            if bound is None:
                return int(ErrorCode.INTERNAL_ERROR)
            port_holder, port = bound
            hostname = f"{local_hostname}:{port}"
        try:
            client = ClientPool.connect(address, namespace=namespace,
                                        client_name=f"mooncake-store:{hostname}",
                                        timeout_s=CLIENT_TIMEOUT_S)
        except ValueError:
            code = INVALID
        except OSError:
            code = RPC_FAIL
        except MooncakedError as exc:
            code = _mooncake_code(exc.code)
        else:
            code = OK
        if code != OK:
            if port_holder is not None:
                port_holder.close()
            return code
        self.close()  # a second setup replaces the first connection, as in Mooncake
        with self._lock:
            self._client = client
            self._hostname = hostname
            self._port_holder = port_holder
            self._local_buffer_size = local_buffer_size
        return OK

    def close(self) -> int:
        """Idempotent, safe from several threads; calls in flight finish with RPC_FAIL or
        their result, later calls answer the not-initialized code."""
        with self._lock:
            client, self._client = self._client, None
            port_holder, self._port_holder = self._port_holder, None
            pool_memory, self._pool_memory = self._pool_memory, {}
            self._buffers.clear()
            self._put_sessions.clear()
            self._get_sessions.clear()
        if client is not None:
            client.close()
        if port_holder is not None:
            port_holder.close()
        for region in pool_memory.values():
            region.close()
        return OK

    def get_hostname(self) -> str:
        """`host:port`, as Mooncake names a client: the given hostname when it has a port,
        else the host with a port held from Mooncake's client port range."""
        with self._lock:
            return self._hostname

    def health_check(self) -> int:
        """0 healthy, 1 not set up or closed, 2 the daemon is unreachable."""
        client = self._current()
        if client is None:
            return 1
        try:
            client.ping()
        except (MooncakedError, OSError):
            return 2
        return 0

    def get_offload_rpc_read_count(self) -> int:
        return 0  # no SSD offload, so no offload reads

    def _get_pyclient_capsule(self):
        return None  # no C++ client to hand out

    # -- plumbing ---------------------------------------------------------------------------

    def _current(self) -> ClientPool | None:
        with self._lock:
            return self._client

    def _run(self, work: Callable[[ClientPool], object], not_initialized=NOT_INITIALIZED,
             on_error: Callable[[int], object] = lambda code: code):
        """work(client)'s result; on_error(code) when it fails; `not_initialized` before
        setup and after close."""
        client = self._current()
        if client is None:
            return not_initialized
        try:
            return work(client)
        except _Failure as failure:
            return on_error(failure.code)
        except MooncakedError as exc:
            return on_error(_mooncake_code(exc.code))
        except OSError:
            return on_error(RPC_FAIL)

    def _run_batch(self, count: int, work: Callable[[ClientPool], list]) -> list:
        return self._run(work, [NOT_INITIALIZED] * count, lambda code: [code] * count)

    @staticmethod
    def _addressable(address: int, _size: int) -> bool:
        """Mooncake's TCP transport copies to and from any address, registered or not; only
        a null address is refused here (Mooncake would crash on it)."""
        return address > 0

    def _staged(self, size: int) -> bool:
        """Mooncake stages a put through its local buffer: a value must fit in it."""
        with self._lock:
            return 0 < size <= self._local_buffer_size

    @staticmethod
    def _wire_config(config: ReplicateConfig | None) -> calls.ReplicateConfig | None:
        if config is None:
            return None
        if not isinstance(config, ReplicateConfig):
            raise TypeError("config must be a ReplicateConfig")
        if config.soft_pin_ttl_ms is not None and config.soft_pin_action != SoftPinAction.ENABLE:
            raise _Failure(INVALID)
        preferred = [config.preferred_segment] if config.preferred_segment else \
            list(config.preferred_segments)
        return calls.ReplicateConfig(
            replica_num=config.replica_num, preferred_segments=preferred,
            with_soft_pin=config.soft_pin_action == SoftPinAction.ENABLE,
            soft_pin_ttl_ms=config.soft_pin_ttl_ms, with_hard_pin=config.with_hard_pin)

    def _checked_config(self, config, count: int | None = None) -> calls.ReplicateConfig | None:
        """The wire config, or _Failure(INVALID) for a config Mooncake refuses (a TTL without
        ENABLE; group_ids not one per key in a batch)."""
        if config is not None and count is not None and config.group_ids is not None \
                and len(config.group_ids) != count:
            raise _Failure(INVALID)
        return self._wire_config(config)

    # -- buffers ----------------------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        if self._current() is None:
            return NOT_INITIALIZED
        if buffer_ptr <= 0 or size <= 0:
            return INVALID
        with self._lock:
            if any(start < buffer_ptr + size and buffer_ptr < start + length
                   for start, length in self._buffers.items()):
                return INVALID  # Mooncake: already registered, or overlapping a region
            self._buffers[buffer_ptr] = size
        return OK

    def unregister_buffer(self, buffer_ptr: int) -> int:
        if self._current() is None:
            return NOT_INITIALIZED
        with self._lock:
            return OK if self._buffers.pop(buffer_ptr, None) is not None else INVALID

    def alloc_from_mem_pool(self, size: int) -> int:
        """An address of `size` bytes of registered memory owned by the store until close
        (Mooncake allocates from the dummy client's shared pool); 0 on failure."""
        if size <= 0 or self._current() is None:
            return 0
        region = _AnonymousMemory(size)
        with self._lock:
            self._pool_memory[region.address] = region
            self._buffers[region.address] = size
        return region.address

    # -- values through Python objects ------------------------------------------------------

    def put(self, key: str, value, config: ReplicateConfig = None) -> int:
        size = memoryview(value).nbytes
        if not self._staged(size):
            return INVALID if self._current() is not None else NOT_INITIALIZED
        return self._run(lambda c: _stored(c.put(key, value, self._checked_config(config))))

    def upsert(self, key: str, value, config: ReplicateConfig = None) -> int:
        size = memoryview(value).nbytes
        if not self._staged(size):
            return INVALID if self._current() is not None else NOT_INITIALIZED
        return self._run(lambda c: c.upsert(key, value, self._checked_config(config)) or OK)

    def put_parts(self, key: str, *args, config: ReplicateConfig = None) -> int:
        """The parts (bytes-like objects) concatenated, stored as one object. No parts, or
        only empty ones: 0 and nothing stored (Mooncake; a plain put of b"" is -600)."""
        value = b"".join(memoryview(p).cast("B") for p in args)
        if not value and self._current() is not None:
            return OK
        return self.put(key, value, config)

    def upsert_parts(self, key: str, *args, config: ReplicateConfig = None) -> int:
        value = b"".join(memoryview(p).cast("B") for p in args)
        if not value and self._current() is not None:
            return OK
        return self.upsert(key, value, config)

    def put_batch(self, keys: Sequence[str], values: Sequence,
                  config: ReplicateConfig = None) -> int:
        """0 when every key is stored (or existed), else the first failure's code."""
        return self._write_batch(keys, values, config, upsert=False)

    def upsert_batch(self, keys: Sequence[str], values: Sequence,
                     config: ReplicateConfig = None) -> int:
        return self._write_batch(keys, values, config, upsert=True)

    def _write_batch(self, keys, values, config, upsert: bool) -> int:
        if len(keys) != len(values):
            return INVALID
        if any(not self._staged(memoryview(v).nbytes) for v in values):
            return INVALID if self._current() is not None else NOT_INITIALIZED
        first = _first_of_each(keys)  # Mooncake: a repeated key keeps its first value
        keys, values = [keys[i] for i in first], [values[i] for i in first]

        def work(client):
            wire = self._checked_config(config, len(keys))
            if upsert:
                for key, value in zip(keys, values):
                    client.upsert(key, value, wire)
                return OK
            codes = client.batch_put(keys, values, wire)
            failed = [_mooncake_code(code) for code in codes if code < 0]
            return failed[0] if failed else OK
        return self._run(work)

    def get(self, key: str) -> bytes:
        return self._run(lambda c: c.get(key), b"", lambda code: b"")

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        """The values, b"" for a miss. Mooncake answers [b""] for an empty key list."""
        if not keys:
            return [b""]
        return self._run(lambda c: [v if v is not None else b"" for v in c.batch_get(keys)],
                         [b"" for _ in keys], lambda code: [b"" for _ in keys])

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The value in a BufferHandle (ptr(), size(), len(), buffer protocol); None on a miss."""
        def work(client):
            value = client.get(key)
            return BufferHandle(value)
        return self._run(work, None, lambda code: None)

    def batch_get_buffer(self, keys: Sequence[str]) -> list[BufferHandle | None]:
        def work(client):
            return [None if v is None else BufferHandle(v) for v in client.batch_get(keys)]
        return self._run(work, [None for _ in keys], lambda code: [None for _ in keys])

    # -- values at raw addresses ------------------------------------------------------------

    def put_from(self, key: str, buffer_ptr: int, size: int,
                 config: ReplicateConfig = None) -> int:
        return self._put_from(key, buffer_ptr, size, config, upsert=False)

    def upsert_from(self, key: str, buffer_ptr: int, size: int,
                    config: ReplicateConfig = None) -> int:
        return self._put_from(key, buffer_ptr, size, config, upsert=True)

    def _put_from(self, key, buffer_ptr, size, config, upsert: bool) -> int:
        if self._current() is None:
            return NOT_INITIALIZED
        if size == 0:
            return OK  # Mooncake: an empty put_from succeeds and stores nothing
        if size < 0 or not self._addressable(buffer_ptr, size):
            return INVALID
        if upsert:
            return self._run(lambda c: c.upsert(
                key, (ctypes.c_char * size).from_address(buffer_ptr),
                self._checked_config(config)) or OK)
        return self._run(lambda c: _stored(c.put_from(key, buffer_ptr, size,
                                                      self._checked_config(config))))

    def put_from_with_metadata(self, key: str, buffer_ptr: int, metadata_buffer_ptr: int,
                               size: int, metadata_size: int,
                               config: ReplicateConfig = None) -> int:
        """One object: metadata_size bytes at metadata_buffer_ptr, then size bytes at
        buffer_ptr. Mooncake answers -1 for its failures here and 0 for an empty put."""
        if self._current() is None or (config is not None and config.prefer_alloc_in_same_node):
            return -1
        if size == 0:
            return OK
        if not self._addressable(buffer_ptr, size) or \
                (metadata_size and not self._addressable(metadata_buffer_ptr, metadata_size)):
            return INVALID
        ranges = [[(0, metadata_buffer_ptr, metadata_size), (metadata_size, buffer_ptr, size)]]
        codes = self._run_batch(1, lambda c: c.batch_put_from_ranges(
            [key], [metadata_size + size], ranges, self._checked_config(config)))
        return OK if codes[0] in (0, 1) else codes[0]

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        if self._current() is None:
            return NOT_INITIALIZED
        if size <= 0 or not self._addressable(buffer_ptr, size):
            return INVALID
        return self._run(lambda c: c.get_into_address(key, buffer_ptr, size))

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int], config: ReplicateConfig = None) -> list[int]:
        """A repeated key: every copy answers 0 and the value is the last one's (Mooncake
        copies each buffer in order into the one object)."""
        results = self._addressed_batch(
            keys, buffer_ptrs, sizes,
            lambda c, k, p, s: c.batch_put_from(k, p, s, self._checked_config(config, len(keys))),
            unique=_last_of_each)
        return [OK if code == 1 else code for code in results]  # an existing key: success

    def batch_upsert_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                          sizes: Sequence[int], config: ReplicateConfig = None) -> list[int]:
        def upsert_each(client, k, p, s):
            wire = self._checked_config(config, len(keys))
            codes = []
            for key, address, size in zip(k, p, s):
                try:
                    client.upsert(key, (ctypes.c_char * size).from_address(address), wire)
                    codes.append(OK)
                except MooncakedError as exc:
                    codes.append(_mooncake_code(exc.code))
            return codes
        return self._addressed_batch(keys, buffer_ptrs, sizes, upsert_each)

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int]) -> list[int]:
        return self._addressed_batch(keys, buffer_ptrs, sizes,
                                      lambda c, k, p, s: c.batch_get_into(k, p, s))

    def _addressed_batch(self, keys, buffer_ptrs, sizes, run, unique=None) -> list[int]:
        """Run a batch call on the keys with a non-empty buffer; the others get
        INVALID_PARAMS, as in Mooncake. With `unique` (a function of the keys giving the
        indexes to send), a repeated key is sent once and every copy gets its result."""
        if self._current() is None:
            return [NOT_INITIALIZED] * len(keys)
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID] * len(keys)
        valid = [i for i, (p, s) in enumerate(zip(buffer_ptrs, sizes))
                 if s > 0 and self._addressable(p, s)]
        results = [INVALID] * len(keys)
        sent = valid if unique is None else \
            [valid[j] for j in unique([keys[i] for i in valid])]
        if not sent:
            return results
        done = self._run_batch(len(sent), lambda c: run(
            c, [keys[i] for i in sent], [buffer_ptrs[i] for i in sent],
            [sizes[i] for i in sent]))
        by_key = {}
        for i, result in zip(sent, done):
            by_key[keys[i]] = results[i] = _mooncake_code(result) if result < 0 else result
        for i in valid:
            results[i] = by_key[keys[i]]
        return results

    # -- scatter / gather: the calls vLLM's connector uses ----------------------------------

    def _check_multi(self, keys, all_buffer_ptrs, all_sizes) -> list[int] | None:
        """Per key INVALID when its buffers do not match its sizes or one is at a null
        address; None when the whole call is malformed."""
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes):
            return None
        codes = []
        for ptrs, sizes in zip(all_buffer_ptrs, all_sizes):
            ok = (len(ptrs) == len(sizes) and len(ptrs) > 0 and all(s >= 0 for s in sizes)
                  and sum(sizes) > 0
                  and all(s == 0 or self._addressable(p, s) for p, s in zip(ptrs, sizes)))
            codes.append(OK if ok else INVALID)
        return codes

    def batch_put_from_multi_buffers(self, keys: Sequence[str],
                                     all_buffer_ptrs: Sequence[Sequence[int]],
                                     all_sizes: Sequence[Sequence[int]],
                                     config: ReplicateConfig = None) -> list[int]:
        """Per key one object: its buffers concatenated. 0 stored (or already existed),
        or a negative code."""
        return self._multi_put(keys, all_buffer_ptrs, all_sizes, config, upsert=False)

    def batch_upsert_from_multi_buffers(self, keys, all_buffer_ptrs, all_sizes,
                                        config: ReplicateConfig = None) -> list[int]:
        return self._multi_put(keys, all_buffer_ptrs, all_sizes, config, upsert=True)

    def _multi_put(self, keys, all_buffer_ptrs, all_sizes, config, upsert: bool) -> list[int]:
        if self._current() is None:
            return []  # Mooncake's answer before setup and after close
        codes = self._check_multi(keys, all_buffer_ptrs, all_sizes)
        if codes is None:
            return [INVALID] * len(keys)
        valid = [i for i, code in enumerate(codes) if code == OK]
        repeated = {}  # a repeated key keeps its first value; its copies answer the same
        for j in _first_of_each([keys[i] for i in valid]):
            repeated[keys[valid[j]]] = valid[j]
        valid = [i for i in valid if repeated[keys[i]] == i]
        if not valid:
            return codes
        ranges, totals = [], []
        for i in valid:
            offset, key_ranges = 0, []
            for address, size in zip(all_buffer_ptrs[i], all_sizes[i]):
                if size:
                    key_ranges.append((offset, address, size))
                offset += size
            ranges.append(key_ranges)
            totals.append(offset)
        valid_keys = [keys[i] for i in valid]

        def work(client):
            wire = self._checked_config(config, len(keys))
            if upsert:  # no ranged upsert on the wire: gather, then one upsert per key
                results = []
                for key, total, key_ranges in zip(valid_keys, totals, ranges):
                    value = bytearray(total)
                    base = ctypes.addressof((ctypes.c_char * max(total, 1)).from_buffer(value))
                    for offset, address, size in key_ranges:
                        _copy(base + offset, address, size)
                    client.upsert(key, value, wire)
                    results.append(OK)
                return results
            return client.batch_put_from_ranges(valid_keys, totals, ranges, wire)
        done = self._run_batch(len(valid), work)
        for i, result in zip(valid, done):
            codes[i] = OK if result in (0, 1) else _mooncake_code(result)
        for i, key in enumerate(keys):
            if key in repeated and codes[i] == OK:
                codes[i] = codes[repeated[key]]
        return codes

    def batch_get_into_multi_buffers(self, keys: Sequence[str],
                                     all_buffer_ptrs: Sequence[Sequence[int]],
                                     all_sizes: Sequence[Sequence[int]],
                                     prefer_alloc_in_same_node: bool = False) -> list[int]:
        """Per key the value scattered over its buffers in order: the value's size, or
        Mooncake's code: OBJECT_NOT_FOUND; INVALID_PARAMS when the sizes add up to less than
        the value; TRANSFER_FAIL when they add up to more, or a key has not as many sizes
        as buffers. prefer_alloc_in_same_node is accepted: a single daemon has one node."""
        if self._current() is None:
            return [NOT_INITIALIZED] * len(keys)
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes):
            return [INVALID] * len(keys)
        codes = [INVALID] * len(keys)
        valid, uneven, ranges, capacities = [], [], [], []
        for i, (ptrs, sizes) in enumerate(zip(all_buffer_ptrs, all_sizes)):
            if len(ptrs) != len(sizes):
                uneven.append(i)
                continue
            if sum(sizes) <= 0 or any(s < 0 or (s and not self._addressable(p, s))
                                      for p, s in zip(ptrs, sizes)):
                continue  # stays INVALID
            offset, key_ranges = 0, []
            for address, size in zip(ptrs, sizes):
                if size:
                    key_ranges.append((offset, address, size))
                offset += size
            valid.append(i)
            ranges.append(key_ranges)
            capacities.append(offset)

        def work(client):
            # A value larger than its buffers is refused (INVALID_PARAMS), nothing copied.
            done = client.batch_get_into_ranges([keys[i] for i in valid], ranges,
                                                capacities) if valid else []
            for i, result, capacity in zip(valid, done, capacities):
                if result < 0:
                    codes[i] = _mooncake_code(result)
                else:  # Mooncake's copy fails when the buffers are larger than the value
                    codes[i] = result if result == capacity else TRANSFER_FAIL
            for i in uneven:
                try:
                    size = client.get_size(keys[i])
                except MooncakedError as exc:
                    size = _mooncake_code(exc.code)
                if size < 0:
                    codes[i] = size
                else:
                    codes[i] = INVALID if size > sum(all_sizes[i]) else TRANSFER_FAIL
            return codes
        if not valid and not uneven:
            return codes
        return self._run_batch(len(keys), work)

    def get_into_ranges(self, buffer_ptrs: Sequence[int], all_keys: Sequence[Sequence[str]],
                        all_dst_offsets, all_src_offsets, all_sizes) -> list:
        """For buffer i, key j, range k: copy all_sizes[i][j][k] bytes from offset
        all_src_offsets[i][j][k] of the value to buffer i at all_dst_offsets[i][j][k].
        Returns [i][j][k] the bytes copied or a negative code (INVALID_PARAMS for a range
        outside the value or the registered buffer; the buffer is then not to be read)."""
        def shaped(code):  # Mooncake's shape: one row per buffer, 1 where a list is short
            return [[[code] * (len(all_dst_offsets[i][j]) if i < len(all_dst_offsets)
                               and j < len(all_dst_offsets[i]) else 1)
                     for j in range(len(all_keys[i]) if i < len(all_keys) else 1)]
                    for i in range(len(buffer_ptrs))]
        if self._current() is None:
            return shaped(NOT_INITIALIZED)
        if not len(buffer_ptrs) == len(all_keys) == len(all_dst_offsets) == \
                len(all_src_offsets) == len(all_sizes):
            return shaped(INVALID)
        results = shaped(INVALID)
        # One gather per (key): every range of the key over all buffers.
        requests: dict[str, list[tuple[int, int, int, int, int, int]]] = {}
        for i, buffer in enumerate(buffer_ptrs):
            with self._lock:
                capacity = next((start + length - buffer for start, length
                                 in self._buffers.items()
                                 if start <= buffer < start + length), 0)
            keys = all_keys[i]
            if not capacity or not len(keys) == len(all_dst_offsets[i]) == \
                    len(all_src_offsets[i]) == len(all_sizes[i]):
                continue
            for j, key in enumerate(keys):
                dsts, srcs, sizes = all_dst_offsets[i][j], all_src_offsets[i][j], all_sizes[i][j]
                if not len(dsts) == len(srcs) == len(sizes):
                    continue
                for k, (dst, src, size) in enumerate(zip(dsts, srcs, sizes)):
                    if dst + size > capacity:
                        continue  # stays INVALID
                    requests.setdefault(key, []).append((i, j, k, src, buffer + dst, size))
        if not requests:
            return results
        keys = list(requests)
        ranges = [[(src, address, size) for _i, _j, _k, src, address, size in requests[key]]
                  for key in keys]
        sizes = self._run_batch(len(keys), lambda c: c.batch_get_into_ranges(keys, ranges))
        for key, value_size in zip(keys, sizes):
            for i, j, k, src, _address, size in requests[key]:
                if value_size < 0:
                    results[i][j][k] = _mooncake_code(value_size)
                else:  # Mooncake: a range past the value's end is INVALID_PARAMS
                    results[i][j][k] = size if src + size <= value_size else INVALID
        return results

    # -- sessions: reserve, fill by ranges, then publish ------------------------------------

    def batch_put_session_start(self, keys: Sequence[str], sizes: Sequence[int],
                                config: ReplicateConfig = None) -> list[int]:
        """Reserve objects of `sizes` bytes; fill them with batch_put_from_multi_buffer_ranges
        and make them readable with batch_put_session_end. Per key 0, OBJECT_ALREADY_EXISTS,
        or INVALID_PARAMS. The bytes are staged in this process until the end."""
        if self._current() is None:
            return [NOT_INITIALIZED] * len(keys)
        if len(keys) != len(sizes):
            return [INVALID] * len(keys)
        exists = self._run_batch(len(keys), lambda c: c.batch_exists(keys))
        codes = []
        with self._lock:
            for key, size, found in zip(keys, sizes, exists):
                if type(found) is int and not isinstance(found, bool):
                    codes.append(found)  # the existence check failed
                elif found:
                    codes.append(ALREADY_EXISTS)
                elif size <= 0 or key in self._put_sessions:
                    codes.append(INVALID)
                else:
                    self._put_sessions[key] = (bytearray(size), config)
                    codes.append(OK)
        return codes

    def batch_put_from_multi_buffer_ranges(self, keys: Sequence[str],
                                           all_buffer_ptrs: Sequence[Sequence[int]],
                                           all_sizes: Sequence[Sequence[int]],
                                           all_dst_offsets: Sequence[Sequence[int]]) -> list[int]:
        """Copy buffers into started put sessions at the given offsets; per key 0 or
        INVALID_PARAMS (no session, a range past the object's end, unregistered memory)."""
        if self._current() is None:
            return [NOT_INITIALIZED] * len(keys)
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes) == len(all_dst_offsets):
            return [INVALID] * len(keys)
        codes = []
        for key, ptrs, sizes, offsets in zip(keys, all_buffer_ptrs, all_sizes, all_dst_offsets):
            with self._lock:
                session = self._put_sessions.get(key)
            if session is None or not len(ptrs) == len(sizes) == len(offsets):
                codes.append(INVALID)
                continue
            staging = session[0]
            if any(o < 0 or s < 0 or o + s > len(staging) or
                   (s and not self._addressable(p, s)) for p, s, o in zip(ptrs, sizes, offsets)):
                codes.append(INVALID)
                continue
            base = ctypes.addressof((ctypes.c_char * len(staging)).from_buffer(staging))
            for address, size, offset in zip(ptrs, sizes, offsets):
                _copy(base + offset, address, size)
            codes.append(OK)
        return codes

    def batch_put_session_end(self, keys: Sequence[str]) -> list[int]:
        """Store the sessions' objects; per key 0 or a negative code (INVALID_PARAMS when the
        key has no session)."""
        if self._current() is None:
            return [NOT_INITIALIZED] * len(keys)
        with self._lock:
            sessions = [self._put_sessions.pop(key, None) for key in keys]
        codes = [INVALID] * len(keys)
        for i, (key, session) in enumerate(zip(keys, sessions)):
            if session is not None:
                staging, config = session
                codes[i] = self._run(lambda c: OK if c.put(
                    key, staging, self._checked_config(config)) else ALREADY_EXISTS)
        return codes

    def batch_put_session_revoke(self, keys: Sequence[str]) -> list[int]:
        if self._current() is None:
            return [NOT_INITIALIZED] * len(keys)
        with self._lock:
            return [OK if self._put_sessions.pop(key, None) is not None else INVALID
                    for key in keys]

    def batch_get_session_start(self, keys: Sequence[str]) -> list[int]:
        """Check the keys once; per key 0 or a negative code (OBJECT_NOT_FOUND)."""
        if self._current() is None:
            return [NOT_INITIALIZED] * len(keys)
        if not keys:
            return []
        found = self._run_batch(len(keys), lambda c: c.batch_exists(keys))
        codes = []
        with self._lock:
            for key, exists in zip(keys, found):
                if type(exists) is int and not isinstance(exists, bool):
                    codes.append(exists)
                elif exists:
                    self._get_sessions.add(key)
                    codes.append(OK)
                else:
                    self._get_sessions.discard(key)
                    codes.append(NOT_FOUND)
        return codes

    def batch_get_into_multi_buffer_ranges(self, keys: Sequence[str],
                                           all_buffer_ptrs: Sequence[Sequence[int]],
                                           all_sizes: Sequence[Sequence[int]],
                                           all_src_offsets: Sequence[Sequence[int]]) -> list[int]:
        """Copy ranges of each value (offset all_src_offsets[i][k], all_sizes[i][k] bytes) to
        the buffers; per key the bytes copied, or a negative code."""
        if self._current() is None:
            return [NOT_INITIALIZED] * len(keys)
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes) == len(all_src_offsets):
            return [INVALID] * len(keys)
        codes, valid, ranges = [INVALID] * len(keys), [], []
        for i, (ptrs, sizes, offsets) in enumerate(zip(all_buffer_ptrs, all_sizes,
                                                        all_src_offsets)):
            if len(ptrs) == len(sizes) == len(offsets) and all(
                    s >= 0 and o >= 0 and (s == 0 or self._addressable(p, s))
                    for p, s, o in zip(ptrs, sizes, offsets)):
                valid.append(i)
                ranges.append([(o, p, s) for p, s, o in zip(ptrs, sizes, offsets) if s])
        if not valid:
            return codes
        done = self._run_batch(len(valid), lambda c: c.batch_get_into_ranges(
            [keys[i] for i in valid], ranges))
        for i, key_ranges, value_size in zip(valid, ranges, done):
            if value_size < 0:
                codes[i] = _mooncake_code(value_size)
            else:
                codes[i] = sum(max(0, min(s, value_size - o)) for o, _p, s in key_ranges)
        return codes

    def batch_get_session_end(self, keys: Sequence[str]) -> int:
        if self._current() is None:
            return NOT_INITIALIZED
        with self._lock:
            for key in keys:
                self._get_sessions.discard(key)
        return OK

    # -- queries and removal ----------------------------------------------------------------

    # An empty key is never found (Mooncake; the daemon refuses it as INVALID_PARAMS).

    def is_exist(self, key: str) -> int:
        return self._run(lambda c: 1 if key != "" and c.exists(key) else 0)

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        if not keys:
            return []
        return self._without_empty_keys(keys, 0, lambda c, named: [
            1 if found else 0 for found in c.batch_exists(named)])

    def get_size(self, key: str) -> int:
        return self._run(lambda c: c.get_size(key) if key != "" else NOT_FOUND)

    def remove(self, key: str, force: bool = False) -> int:
        return self._run(lambda c: (c.remove(key, force) or OK) if key != "" else NOT_FOUND)

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        return self._without_empty_keys(keys, NOT_FOUND, lambda c, named: [
            _mooncake_code(code) if code < 0 else code for code in c.batch_remove(named, force)])

    def _without_empty_keys(self, keys, missing, work) -> list:
        """work(client, the non-empty keys), with `missing` in the places of empty keys."""
        named = [i for i, key in enumerate(keys) if key != ""]

        def run(client):
            results = [missing] * len(keys)
            if named:
                for i, result in zip(named, work(client, [keys[i] for i in named])):
                    results[i] = result
            return results
        return self._run_batch(len(keys), run)

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        return self._run(lambda c: c.remove_by_regex(regex_pattern, force))

    def remove_all(self, force: bool = False) -> int:
        return self._run(lambda c: c.remove_all(force))

    def get_replica_desc(self, key: str) -> list[ReplicaDescriptor]:
        """The object's replicas (memory replicas in the daemon's segments); [] on a miss."""
        return self.batch_get_replica_desc([key]).get(key, [])

    def batch_get_replica_desc(self, keys: Sequence[str]) -> dict[str, list[ReplicaDescriptor]]:
        """{key: replicas} for the keys found (Mooncake leaves missing keys out)."""
        def work(client):
            endpoint = client.server.get("node_name", "") if isinstance(client.server, dict) \
                else ""
            found = {}
            for key in keys:
                try:
                    stat = client.object_stat(key)
                except MooncakedError as exc:
                    if exc.code == NOT_FOUND:
                        continue
                    raise
                status = ReplicaStatus.COMPLETE if stat.get("state") == "complete" \
                    else ReplicaStatus.PROCESSING
                found[key] = [
                    ReplicaDescriptor(status, MemoryDescriptor(Descriptor(
                        stat.get("size_bytes", 0), replica.get("offset", 0),
                        f"{endpoint}/segment-{replica.get('segment_id')}")))
                    for replica in stat.get("replicas", [])]
            return found
        return self._run(work, {}, lambda code: {})

    def batch_replica_clear(self, keys: Sequence[str], segment_name: str = "") -> list[str]:
        """Remove the objects whose read lease has expired; the keys cleared. With one
        daemon an object's replicas all lie in its segments, so segment_name is accepted but
        clears the whole object."""
        def work(client):
            codes = client.batch_remove(list(keys), False)
            return [key for key, code in zip(keys, codes) if code == 0]
        return self._run(work, [], lambda code: [])

    # -- segments and tasks: the daemon owns memory and placement ---------------------------

    def mount_segment(self, path: str, size: int, offset: int = 0, protocol: str = "tcp",
                      location: str = "") -> dict:
        return {"ret": NOT_SUPPORTED, "segment_ids": []}

    def allocate_and_mount_segment(self, size: int, protocol: str = "tcp",
                                   location: str = "") -> dict:
        return {"ret": NOT_SUPPORTED, "segment_ids": [], "allocated_size": 0}

    def unmount_segment(self, segment_ids: Sequence[str], grace_period_seconds: int = 0) -> int:
        return NOT_SUPPORTED

    def unmount_and_free_segment(self, segment_ids: Sequence[str],
                                 grace_period_seconds: int = 0) -> int:
        return NOT_SUPPORTED

    def unmount_local_disk_segment(self, grace_period_seconds: int = 0) -> int:
        return NOT_SUPPORTED

    def create_copy_task(self, key: str, targets: Sequence[str]) -> tuple:
        return (0, 0), NOT_SUPPORTED

    def create_move_task(self, key: str, source: str, target: str) -> tuple:
        return (0, 0), NOT_SUPPORTED

    def query_task(self, task_id: tuple) -> tuple:
        return None, NOT_SUPPORTED

    # -- tensors ----------------------------------------------------------------------------

    def _put_objects(self, keys: list[str], objects: list[bytes], config,
                     upsert: bool) -> list[int]:
        """Store whole objects; per key 0 or a negative code (an existing key: success)."""
        def work(client):
            wire = self._checked_config(config, len(keys))
            if upsert:
                codes = []
                for key, value in zip(keys, objects):
                    try:
                        client.upsert(key, value, wire)
                        codes.append(OK)
                    except MooncakedError as exc:
                        codes.append(_mooncake_code(exc.code))
                return codes
            return [OK if code in (0, 1) else _mooncake_code(code)
                    for code in client.batch_put(keys, objects, wire)]
        return self._run_batch(len(keys), work)

    def _put_tensors(self, keys, tensor_list, config, upsert: bool) -> list[int]:
        if self._current() is None:
            return [NOT_INITIALIZED] * len(keys)
        if len(keys) != len(tensor_list):
            return [INVALID] * len(keys)
        tensors.torch_module()
        infos = [tensors.tensor_info(t) for t in tensor_list]
        codes = [INVALID if info is None else OK for info in infos]
        valid = [i for i, info in enumerate(infos) if info is not None]
        done = self._put_objects([keys[i] for i in valid],
                                 [tensors.tensor_bytes(infos[i]) for i in valid], config, upsert)
        for i, code in zip(valid, done):
            codes[i] = code
        return codes

    def put_tensor(self, key: str, tensor) -> int:
        return self._put_tensors([key], [tensor], None, upsert=False)[0]

    def upsert_tensor(self, key: str, tensor) -> int:
        return self._put_tensors([key], [tensor], None, upsert=True)[0]

    def pub_tensor(self, key: str, tensor, config: ReplicateConfig = None) -> int:
        return self._put_tensors([key], [tensor], config, upsert=False)[0]

    def upsert_pub_tensor(self, key: str, tensor, config: ReplicateConfig = None) -> int:
        return self._put_tensors([key], [tensor], config, upsert=True)[0]

    def batch_put_tensor(self, keys: Sequence[str], tensors_list: Sequence) -> list[int]:
        return self._put_tensors(list(keys), list(tensors_list), None, upsert=False)

    def batch_upsert_tensor(self, keys: Sequence[str], tensors_list: Sequence) -> list[int]:
        return self._put_tensors(list(keys), list(tensors_list), None, upsert=True)

    def batch_pub_tensor(self, keys: Sequence[str], tensors_list: Sequence,
                         config: ReplicateConfig = None) -> list[int]:
        return self._put_tensors(list(keys), list(tensors_list), config, upsert=False)

    def batch_upsert_pub_tensor(self, keys: Sequence[str], tensors_list: Sequence,
                                config: ReplicateConfig = None) -> list[int]:
        return self._put_tensors(list(keys), list(tensors_list), config, upsert=True)

    def get_tensor(self, key: str):
        """The tensor stored under key (a CPU tensor owning its bytes), or None."""
        return self.batch_get_tensor([key])[0]

    def batch_get_tensor(self, keys: Sequence[str]) -> list:
        if self._current() is None:
            return [None for _ in keys]
        tensors.torch_module()
        values = self._run(lambda c: c.batch_get(list(keys)), [None for _ in keys],
                           lambda code: [None for _ in keys])
        return [None if v is None else tensors.tensor_from_object(v) for v in values]

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int):
        """Read the object into the registered buffer; a tensor viewing the buffer's data
        part (no copy), or None."""
        return self.batch_get_tensor_into([key], [buffer_ptr], [size])[0]

    def batch_get_tensor_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                              sizes: Sequence[int]) -> list:
        if self._current() is None:
            return [None for _ in keys]
        tensors.torch_module()
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID] * len(keys)  # Mooncake: the codes, not None
        read = self.batch_get_into(keys, buffer_ptrs, sizes)
        return [tensors.tensor_at(ptr, n) if n >= METADATA_SIZE else None
                for ptr, n in zip(buffer_ptrs, read)]

    def _tensor_from_buffer(self, buffer_ptr: int, size: int):
        """The tensor a registered [TensorMetadata][data] buffer holds, or None."""
        if size < METADATA_SIZE or not self._addressable(buffer_ptr, size):
            return None
        return tensors.tensor_at(buffer_ptr, size)

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self.batch_put_tensor_from([key], [buffer_ptr], [size])[0]

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self.batch_upsert_tensor_from([key], [buffer_ptr], [size])[0]

    def batch_put_tensor_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                              sizes: Sequence[int]) -> list[int]:
        """Store [TensorMetadata][data] buffers as they are (the layout get_tensor_into
        reads); INVALID_PARAMS for a buffer that is not a valid tensor object."""
        return self._tensor_buffers(keys, buffer_ptrs, sizes, upsert=False)

    def batch_upsert_tensor_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                                 sizes: Sequence[int]) -> list[int]:
        return self._tensor_buffers(keys, buffer_ptrs, sizes, upsert=True)

    def _tensor_buffers(self, keys, buffer_ptrs, sizes, upsert: bool) -> list[int]:
        if self._current() is None:
            return [NOT_INITIALIZED] * len(keys)
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID] * len(keys)
        codes = []
        for ptr, size in zip(buffer_ptrs, sizes):
            valid = (size >= METADATA_SIZE and self._addressable(ptr, size)
                     and tensors.parse_metadata(ctypes.string_at(ptr, METADATA_SIZE), size))
            codes.append(OK if valid else INVALID)
        valid = [i for i, code in enumerate(codes) if code == OK]
        if not valid:
            return codes
        if upsert:
            done = self.batch_upsert_from([keys[i] for i in valid],
                                          [buffer_ptrs[i] for i in valid],
                                          [sizes[i] for i in valid])
        else:
            done = self.batch_put_from([keys[i] for i in valid], [buffer_ptrs[i] for i in valid],
                                       [sizes[i] for i in valid])
        for i, code in zip(valid, done):
            codes[i] = code
        return codes

    # Tensor parallelism: Mooncake splits a tensor into tp_size equal shards along split_dim
    # and stores shard r under f"{key}_tp_{r}", with shard metadata (one "tp" axis).

    @staticmethod
    def tp_key(key: str, rank: int) -> str:
        return f"{key}_tp_{rank}"

    def _put_tp(self, keys, tensor_list, config, tp_size: int, split_dim: int,
                upsert: bool) -> list[int]:
        if self._current() is None:
            return [NOT_INITIALIZED] * len(keys)
        if len(keys) != len(tensor_list):
            return [INVALID] * len(keys)
        if tp_size <= 1:
            return self._put_tensors(list(keys), list(tensor_list), config, upsert)
        tensors.torch_module()
        codes, shard_keys, shard_objects, owners = [], [], [], []
        for i, (key, tensor) in enumerate(zip(keys, tensor_list)):
            shards = tensors.tp_shards(tensor, tp_size, split_dim)
            if shards is None:
                codes.append(INVALID)
                continue
            codes.append(OK)
            for rank, info in enumerate(shards):
                shard_keys.append(self.tp_key(key, rank))
                shard_objects.append(tensors.tensor_bytes(info))
                owners.append(i)
        done = self._put_objects(shard_keys, shard_objects, config, upsert) if shard_keys else []
        for i, code in zip(owners, done):
            if code != OK and codes[i] == OK:
                codes[i] = code
        return codes

    def put_tensor_with_tp(self, key: str, tensor, tp_rank: int = 0, tp_size: int = 1,
                           split_dim: int = 0) -> int:
        return self._put_tp([key], [tensor], None, tp_size, split_dim, upsert=False)[0]

    def pub_tensor_with_tp(self, key: str, tensor, config: ReplicateConfig = None,
                           tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> int:
        return self._put_tp([key], [tensor], config, tp_size, split_dim, upsert=False)[0]

    def batch_put_tensor_with_tp(self, base_keys: Sequence[str], tensors_list: Sequence,
                                 tp_rank: int = 0, tp_size: int = 1,
                                 split_dim: int = 0) -> list[int]:
        return self._put_tp(base_keys, tensors_list, None, tp_size, split_dim, upsert=False)

    def batch_pub_tensor_with_tp(self, base_keys: Sequence[str], tensors_list: Sequence,
                                 config: ReplicateConfig = None, tp_rank: int = 0,
                                 tp_size: int = 1, split_dim: int = 0) -> list[int]:
        return self._put_tp(base_keys, tensors_list, config, tp_size, split_dim, upsert=False)

    def put_tensor_with_tp_from(self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0,
                                tp_size: int = 1, split_dim: int = 0) -> int:
        return self.batch_put_tensor_with_tp_from([key], [buffer_ptr], [size], tp_rank,
                                                  tp_size, split_dim)[0]

    def batch_put_tensor_with_tp_from(self, base_keys: Sequence[str],
                                      buffer_ptrs: Sequence[int], sizes: Sequence[int],
                                      tp_rank: int = 0, tp_size: int = 1,
                                      split_dim: int = 0) -> list[int]:
        """Full tensors in [TensorMetadata][data] buffers, split and stored per rank."""
        if self._current() is None:
            return [NOT_INITIALIZED] * len(base_keys)
        if not len(base_keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID] * len(base_keys)
        tensors.torch_module()
        if tp_size <= 1:
            return self.batch_put_tensor_from(base_keys, buffer_ptrs, sizes)
        full = [self._tensor_from_buffer(p, s) for p, s in zip(buffer_ptrs, sizes)]
        codes = [INVALID] * len(base_keys)
        valid = [i for i, t in enumerate(full) if t is not None]
        done = self._put_tp([base_keys[i] for i in valid], [full[i] for i in valid], None,
                            tp_size, split_dim, upsert=False)
        for i, code in zip(valid, done):
            codes[i] = code
        return codes

    def get_tensor_with_tp(self, key: str, tp_rank: int = 0, tp_size: int = 1,
                           split_dim: int = 0):
        return self.get_tensor(key if tp_size <= 1 else self.tp_key(key, tp_rank))

    def batch_get_tensor_with_tp(self, base_keys: Sequence[str], tp_rank: int = 0,
                                 tp_size: int = 1) -> list:
        if tp_size <= 1:
            return self.batch_get_tensor(base_keys)
        return self.batch_get_tensor([self.tp_key(k, tp_rank) for k in base_keys])

    def get_tensor_with_tp_into(self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0,
                                tp_size: int = 1, split_dim: int = 0):
        return self.get_tensor_into(key if tp_size <= 1 else self.tp_key(key, tp_rank),
                                    buffer_ptr, size)

    def batch_get_tensor_with_tp_into(self, base_keys: Sequence[str],
                                      buffer_ptrs: Sequence[int], sizes: Sequence[int],
                                      tp_rank: int = 0, tp_size: int = 1) -> list:
        keys = base_keys if tp_size <= 1 else [self.tp_key(k, tp_rank) for k in base_keys]
        return self.batch_get_tensor_into(keys, buffer_ptrs, sizes)

    # General parallel layouts (TensorParallelism / writer partitions / ReadTarget): only the
    # plain form (no parallelism, no writer partition, ReadTarget "as_stored") is provided;
    # the rest answers NOT_SUPPORTED (puts) or None (gets).

    @staticmethod
    def _plain_layout(*specs) -> bool:
        return all(spec is None for spec in specs)

    @staticmethod
    def _plain_target(target) -> bool:
        return target is None or (isinstance(target, ReadTarget) and target.mode == "as_stored")

    def put_tensor_with_parallelism(self, key: str, tensor, parallelism=None,
                                    config: ReplicateConfig = None, writer_partition=None) -> int:
        if not self._plain_layout(parallelism, writer_partition):
            return NOT_SUPPORTED
        return self.pub_tensor(key, tensor, config)

    def upsert_tensor_with_parallelism(self, key: str, tensor, parallelism=None,
                                       config: ReplicateConfig = None,
                                       writer_partition=None) -> int:
        if not self._plain_layout(parallelism, writer_partition):
            return NOT_SUPPORTED
        return self.upsert_pub_tensor(key, tensor, config)

    def batch_put_tensor_with_parallelism(self, keys: Sequence[str], tensors_list: Sequence,
                                          parallelisms=None, config: ReplicateConfig = None,
                                          writer_partitions=None) -> list[int]:
        if not self._plain_layout(parallelisms, writer_partitions):
            return [NOT_SUPPORTED] * len(keys)
        return self.batch_pub_tensor(keys, tensors_list, config)

    def batch_upsert_tensor_with_parallelism(self, keys: Sequence[str], tensors_list: Sequence,
                                             parallelisms=None, config: ReplicateConfig = None,
                                             writer_partitions=None) -> list[int]:
        if not self._plain_layout(parallelisms, writer_partitions):
            return [NOT_SUPPORTED] * len(keys)
        return self.batch_upsert_pub_tensor(keys, tensors_list, config)

    def put_tensor_with_parallelism_from(self, key: str, buffer_ptr: int, size: int,
                                         parallelism=None, config: ReplicateConfig = None,
                                         writer_partition=None) -> int:
        if not self._plain_layout(parallelism, writer_partition):
            return NOT_SUPPORTED
        return self.put_tensor_from(key, buffer_ptr, size)

    def upsert_tensor_with_parallelism_from(self, key: str, buffer_ptr: int, size: int,
                                            parallelism=None, config: ReplicateConfig = None,
                                            writer_partition=None) -> int:
        if not self._plain_layout(parallelism, writer_partition):
            return NOT_SUPPORTED
        return self.upsert_tensor_from(key, buffer_ptr, size)

    def batch_put_tensor_with_parallelism_from(self, keys: Sequence[str],
                                               buffer_ptrs: Sequence[int], sizes: Sequence[int],
                                               parallelisms=None, config: ReplicateConfig = None,
                                               writer_partitions=None) -> list[int]:
        if not self._plain_layout(parallelisms, writer_partitions):
            return [NOT_SUPPORTED] * len(keys)
        return self.batch_put_tensor_from(keys, buffer_ptrs, sizes)

    def batch_upsert_tensor_with_parallelism_from(self, keys: Sequence[str],
                                                  buffer_ptrs: Sequence[int],
                                                  sizes: Sequence[int], parallelisms=None,
                                                  config: ReplicateConfig = None,
                                                  writer_partitions=None) -> list[int]:
        if not self._plain_layout(parallelisms, writer_partitions):
            return [NOT_SUPPORTED] * len(keys)
        return self.batch_upsert_tensor_from(keys, buffer_ptrs, sizes)

    def get_tensor_with_parallelism(self, key: str, target=None):
        return self.get_tensor(key) if self._plain_target(target) else None

    def batch_get_tensor_with_parallelism(self, keys: Sequence[str], targets=None) -> list:
        plain = targets is None or all(self._plain_target(t) for t in targets)
        return self.batch_get_tensor(keys) if plain else [None for _ in keys]

    def get_tensor_with_parallelism_into(self, key: str, buffer_ptr: int, size: int,
                                         target=None):
        return self.get_tensor_into(key, buffer_ptr, size) if self._plain_target(target) \
            else None

    def batch_get_tensor_with_parallelism_into(self, keys: Sequence[str],
                                               buffer_ptrs: Sequence[int],
                                               sizes: Sequence[int], targets=None) -> list:
        plain = targets is None or all(self._plain_target(t) for t in targets)
        return self.batch_get_tensor_into(keys, buffer_ptrs, sizes) if plain \
            else [None for _ in keys]

    def get_tensor_into_cuda(self, key: str, tensor) -> int:
        """Copy the stored tensor's payload into a pre-allocated tensor of the same dtype and
        shape (any device torch can copy to); the bytes copied, or a negative code."""
        return self.batch_get_tensor_into_cuda([key], [tensor])[0]

    def batch_get_tensor_into_cuda(self, keys: Sequence[str], tensors_list: Sequence) -> list[int]:
        if self._current() is None:
            return [NOT_INITIALIZED] * len(keys)
        if len(keys) != len(tensors_list):
            return [INVALID] * len(keys)
        stored = self.batch_get_tensor(keys)
        exists = self.batch_is_exist(keys)
        codes = []
        for source, target, found in zip(stored, tensors_list, exists):
            if source is None:
                codes.append(NOT_FOUND if found == 0 else INVALID)
            elif (not hasattr(target, "copy_") or not target.is_contiguous()
                  or target.dtype != source.dtype or tuple(target.shape) != tuple(source.shape)):
                codes.append(INVALID)
            else:
                target.copy_(source)
                codes.append(source.numel() * source.element_size())
        return codes

    def save_tensor_to_safetensor(self, key: str, file_name=None) -> int:
        """Write the tensor under key to a safetensors file (named key when no file_name),
        the tensor named key inside; 0 or a negative code."""
        tensor = self.get_tensor(key)
        if tensor is None:
            return NOT_FOUND if self.is_exist(key) == 0 else INVALID
        try:
            tensors.write_safetensors(str(file_name or key), key, tensor)
        except (OSError, ValueError):
            return INVALID
        return OK

    def load_tensor_from_safetensor(self, key=None, file_name: str = None):
        """Read a tensor from a safetensors file and store it under key (file_name when no
        key); the tensor named key, else the file's first. Returns the tensor, or None."""
        if file_name is None:
            raise TypeError("load_tensor_from_safetensor() missing required argument: "
                            "'file_name'")
        store_key = file_name if key is None else str(key)
        try:
            tensor, _name = tensors.read_safetensors(file_name, store_key)
        except (OSError, ValueError, KeyError):
            return None
        return tensor if self.upsert_tensor(store_key, tensor) == OK else None


def _serialize_tensor(tensor) -> tuple:
    """(metadata bytes, data pointer, data size, owner tensor) for a tensor, as Mooncake's
    `_serialize_tensor`; ValueError for an unsupported tensor."""
    info = tensors.tensor_info(tensor)
    if info is None:
        raise ValueError("unsupported tensor for Mooncake tensor serialization")
    return info.metadata.pack(), info.data_ptr, info.size, info.owner


def _deserialize_tensor(payload: bytes):
    """The tensor in a [TensorMetadata][data] byte string; ValueError if it is not one."""
    tensor = tensors.tensor_from_object(payload)
    if tensor is None:
        raise ValueError("invalid serialized Mooncake tensor payload")
    return tensor


def _tensor_metadata_size() -> int:
    return METADATA_SIZE


__all__ = [
    "ACTIVATION", "BufferHandle", "BufferLease", "BufferLeaseView", "BufferPool", "COMPLETE",
    "Descriptor", "DiskDescriptor", "EngramStore", "EngramStoreConfig", "FAILED", "GENERAL",
    "GRADIENT", "INITIALIZED", "KVCACHE", "METADATA", "MemoryDescriptor",
    "MooncakeDistributedNoFRegister", "MooncakeDistributedStore", "MooncakeHostMemAllocator",
    "OPTIMIZER_STATE", "ObjectDataType", "PENDING", "PROCESSING", "ParallelAxis",
    "QueryTaskResponse", "REMOVED", "REPLICA_COPY", "REPLICA_MOVE", "ReadTarget",
    "RegisteredBufferLease", "RegisteredBufferLeaseView", "RegisteredBufferPool",
    "ReplicaDescriptor", "ReplicaStatus", "ReplicateConfig", "SAMPLE", "SUCCESS",
    "SoftPinAction", "TENSOR", "TaskStatus", "TaskType", "TensorParallelism", "UNDEFINED",
    "UNKNOWN", "WEIGHT", "_deserialize_tensor", "_get_pyclient_from_wrapper",
    "_serialize_tensor", "_tensor_metadata_size", "bind_to_numa_node", "get_alloc_func_addr",
    "get_free_func_addr",
]
