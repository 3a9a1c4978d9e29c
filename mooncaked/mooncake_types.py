"""The value types of Mooncake Store's Python module (`mooncake.store`), written for mooncaked.

Enums print and compare like Mooncake's pybind enums (`str(SoftPinAction.ENABLE)` is
"SoftPinAction.ENABLE"); `ReplicateConfig` checks the type of every assignment and raises
TypeError like the pybind setters do. Re-exported by `mooncaked.mooncake_store`.
"""

from __future__ import annotations

import ctypes
import enum
import mmap
import threading
from typing import Sequence

from mooncaked._native import buffer_address


class _PybindEnum(enum.IntEnum):
    """An IntEnum that prints as pybind11 enums do: `Name.MEMBER`."""

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self.name}: {int(self)}>"


class SoftPinAction(_PybindEnum):
    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ObjectDataType(_PybindEnum):
    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


class ReplicaStatus(_PybindEnum):
    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class TaskType(_PybindEnum):
    REPLICA_COPY = 0
    REPLICA_MOVE = 1


class TaskStatus(_PybindEnum):
    PENDING = 0
    PROCESSING = 1
    FAILED = 2
    SUCCESS = 3


def _type_error(cls_name: str, field: str, expected: str, value) -> TypeError:
    return TypeError(f"(): incompatible function arguments. {cls_name}.{field} takes "
                     f"{expected}, not {type(value).__name__} ({value!r})")


def _check_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, enum.Enum)


def _check_str_list(value) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)


# field -> (default factory, check, expected type in words, normalise)
_REPLICATE_FIELDS = {
    "replica_num": (lambda: 1, lambda v: _check_int(v) and v >= 0, "int (>= 0)", int),
    "nof_replica_num": (lambda: 0, lambda v: _check_int(v) and v >= 0, "int (>= 0)", int),
    "dfs_replica_num": (lambda: 0, lambda v: _check_int(v) and v >= 0, "int (>= 0)", int),
    "soft_pin_action": (lambda: SoftPinAction.PRESERVE,
                        lambda v: isinstance(v, SoftPinAction), "SoftPinAction",
                        SoftPinAction),
    "soft_pin_ttl_ms": (lambda: None, lambda v: v is None or (_check_int(v) and v >= 0),
                        "Optional[int]", lambda v: v),
    "with_hard_pin": (lambda: False, lambda v: isinstance(v, bool), "bool", bool),
    "preferred_segments": (list, _check_str_list, "list[str]", list),
    "preferred_nof_segments": (list, _check_str_list, "list[str]", list),
    "preferred_segment": (str, lambda v: isinstance(v, str), "str", str),
    "prefer_alloc_in_same_node": (lambda: False, lambda v: isinstance(v, bool), "bool", bool),
    "data_type": (lambda: ObjectDataType.UNKNOWN, lambda v: isinstance(v, ObjectDataType),
                  "ObjectDataType", ObjectDataType),
    "group_ids": (lambda: None, lambda v: v is None or _check_str_list(v),
                  "Optional[list[str]]", lambda v: v if v is None else list(v)),
}


class ReplicateConfig:
    """Mooncake's ReplicateConfig: every field, Mooncake's defaults, typed assignment.

    mooncaked uses replica_num, soft_pin_action / soft_pin_ttl_ms, with_hard_pin,
    preferred_segments / preferred_segment; the others are kept and printed but have no
    effect (README, "Mooncake API differences").
    """

    __slots__ = tuple(_REPLICATE_FIELDS)

    def __init__(self) -> None:
        for field, (default, _check, _expected, _normalise) in _REPLICATE_FIELDS.items():
            object.__setattr__(self, field, default())

    def __setattr__(self, field: str, value) -> None:
        spec = _REPLICATE_FIELDS.get(field)
        if spec is None:
            raise AttributeError(f"'ReplicateConfig' object has no attribute '{field}'")
        _default, check, expected, normalise = spec
        if not check(value):
            raise _type_error("ReplicateConfig", field, expected, value)
        object.__setattr__(self, field, normalise(value))

    def __str__(self) -> str:
        ttl = "default" if self.soft_pin_ttl_ms is None else str(self.soft_pin_ttl_ms)
        text = ("ReplicateConfig: { "
                f"replica_num: {self.replica_num}, nof_replica_num: {self.nof_replica_num}, "
                f"dfs_replica_num: {self.dfs_replica_num}, "
                f"soft_pin_action: {self.soft_pin_action.name}, soft_pin_ttl_ms: {ttl}, "
                f"with_hard_pin: {int(self.with_hard_pin)}, "
                f"preferred_segments: [{', '.join(self.preferred_segments)}], "
                + (f"preferred_segment (deprecated): {self.preferred_segment}, "
                   if self.preferred_segment else "")
                + f"preferred_nof_segments: [{', '.join(self.preferred_nof_segments)}], "
                f"prefer_alloc_in_same_node: {int(self.prefer_alloc_in_same_node)}, "
                f"data_type: {self.data_type.name}")
        if self.group_ids is not None:
            text += f", group_ids: [{', '.join(self.group_ids)}]"
        return text + " }"

    def __repr__(self) -> str:
        return f"<{self}>"


class BufferHandle(bytearray):
    """A value read by get_buffer: owns its bytes; ptr() / size() / len() / buffer protocol,
    as Mooncake's BufferHandle (which points into the client's local buffer)."""

    def ptr(self) -> int:
        return buffer_address(self) if len(self) else 0

    def size(self) -> int:
        return len(self)


class Descriptor:
    """Where a memory replica lies: Mooncake's AllocatedBuffer descriptor."""

    def __init__(self, size: int = 0, buffer_address: int = 0,
                 transport_endpoint: str = "") -> None:
        self.size = size
        self.buffer_address = buffer_address
        self.transport_endpoint = transport_endpoint

    def __repr__(self) -> str:
        return (f"<Descriptor size={self.size} buffer_address={self.buffer_address} "
                f"transport_endpoint={self.transport_endpoint}>")


class MemoryDescriptor:
    def __init__(self, buffer_descriptor: Descriptor | None = None) -> None:
        self.buffer_descriptor = buffer_descriptor or Descriptor()


class DiskDescriptor:
    def __init__(self, file_path: str = "", object_size: int = 0) -> None:
        self.file_path = file_path
        self.object_size = object_size


class ReplicaDescriptor:
    """One replica of an object. mooncaked keeps replicas in memory only."""

    def __init__(self, status: ReplicaStatus, memory: MemoryDescriptor) -> None:
        self._status = status
        self._memory = memory

    @property
    def status(self) -> ReplicaStatus:
        return self._status

    def is_memory_replica(self) -> bool:
        return True

    def is_disk_replica(self) -> bool:
        return False

    def is_local_disk_replica(self) -> bool:
        return False

    def get_memory_descriptor(self) -> MemoryDescriptor:
        return self._memory

    def get_disk_descriptor(self) -> DiskDescriptor:
        raise RuntimeError("not a disk replica")  # Mooncake's variant access fails too

    def __repr__(self) -> str:
        return f"<ReplicaDescriptor status={self._status} memory={self._memory.buffer_descriptor}>"


class QueryTaskResponse:
    def __init__(self) -> None:
        self.id = (0, 0)
        self.type = TaskType.REPLICA_COPY
        self.status = TaskStatus.PENDING
        self.created_at_ms_epoch = 0
        self.last_updated_at_ms_epoch = 0
        self.assigned_client = (0, 0)
        self.message = ""

    def __repr__(self) -> str:
        return (f"QueryTaskResponse(id={self.id}, type={int(self.type)}, "
                f"status={int(self.status)}, created_at={self.created_at_ms_epoch}, "
                f"last_updated_at={self.last_updated_at_ms_epoch}, "
                f"assigned_client={self.assigned_client}, message=\"{self.message}\")")


class ParallelAxis:
    """One axis of a tensor's parallel layout ("tp", "dp", "ep", "pp")."""

    def __init__(self) -> None:
        self.kind = ""
        self.rank = 0
        self.size = 1
        self.split_dim: int | None = None
        self.expert_id: int | None = None
        self.stage_id: int | None = None


class TensorParallelism:
    def __init__(self) -> None:
        self.axes: list[ParallelAxis] = []


class ReadTarget:
    _MODES = ("as_stored", "shard", "full")

    def __init__(self) -> None:
        self._mode = "as_stored"
        self.parallelism: TensorParallelism | None = None

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        if value not in self._MODES:
            raise RuntimeError("Unsupported ReadTarget mode")
        self._mode = value


class _AnonymousMemory:
    """Page-aligned anonymous memory with a stable address (kept alive by this object)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._map = mmap.mmap(-1, max(size, 1))
        self._view = (ctypes.c_char * max(size, 1)).from_buffer(self._map)
        self.address = ctypes.addressof(self._view)

    def close(self) -> None:
        if self._map is not None:
            del self._view
            self._map.close()
            self._map = None


class MooncakeHostMemAllocator:
    """alloc(size) -> address / free(address) -> 0 or -1: host memory for buffers to register."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[int, _AnonymousMemory] = {}

    def alloc(self, size: int) -> int:
        if size <= 0:
            return 0
        region = _AnonymousMemory(size)
        with self._lock:
            self._regions[region.address] = region
        return region.address

    def free(self, address: int) -> int:
        with self._lock:
            region = self._regions.pop(address, None)
        if region is None:
            return -1
        region.close()
        return 0


class BufferLeaseView:
    """The bytes of a lease (a memoryview over them is `.buffer`)."""

    def __init__(self, address: int, size: int) -> None:
        self._array = (ctypes.c_char * size).from_address(address)

    @property
    def buffer(self) -> memoryview:
        return memoryview(self._array).cast("B")


class BufferLease:
    """A registered buffer lent by BufferPool; give it back with release() or a with block."""

    def __init__(self, pool: "BufferPool", address: int, size: int, capacity: int) -> None:
        self._pool = pool
        self._address = address
        self._size = size
        self._capacity = capacity
        self._released = False

    @property
    def ptr(self) -> int:
        return self._address

    @property
    def size(self) -> int:
        return self._size

    @property
    def buffer(self) -> memoryview:
        return BufferLeaseView(self._address, self._size).buffer

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._pool._give_back(self._address, self._capacity)

    def __enter__(self) -> "BufferLease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class BufferPool:
    """Size-classed pool of buffers registered with a store (Mooncake's BufferPool).

    Buffers are anonymous memory registered with `store.register_buffer`; sizes round up to
    a power of two from min_size_class. With max_bytes > 0, acquire blocks (or raises
    RuntimeError when not blocking / on timeout) once that much is lent and nothing is free.
    """

    def __init__(self, store, max_bytes: int = 0, min_size_class: int = 64 * 1024,
                 max_size_class=None, alignment: int = 8 * 1024 * 1024,
                 block_on_exhaustion: bool = True, default_timeout=None, max_regions=None,
                 prewarm_size=None, prewarm_count: int = 0) -> None:
        if min_size_class <= 0 or alignment <= 0:
            raise ValueError("min_size_class and alignment must be positive")
        self._store = store
        self._max_bytes = max_bytes
        self._min_size_class = min_size_class
        self._max_size_class = max_size_class
        self._block = block_on_exhaustion
        self._default_timeout = default_timeout
        self._condition = threading.Condition()
        self._free: dict[int, list[int]] = {}  # capacity -> free addresses
        self._regions: dict[int, _AnonymousMemory] = {}
        self._allocated_bytes = 0
        self._closing = False
        if prewarm_size is not None and prewarm_count:
            self.prewarm(prewarm_size, prewarm_count)

    def _size_class(self, size: int) -> int:
        capacity = self._min_size_class
        while capacity < size:
            capacity *= 2
        if self._max_size_class is not None and capacity > self._max_size_class:
            return size  # over the largest class: an exact-size buffer
        return capacity

    def _new_region(self, capacity: int) -> int:
        region = _AnonymousMemory(capacity)
        code = self._store.register_buffer(region.address, capacity)
        if code != 0:
            region.close()
            raise RuntimeError(f"register_buffer failed with {code}")
        self._regions[region.address] = region
        self._allocated_bytes += capacity
        return region.address

    def acquire(self, size: int, block=None, timeout=None) -> BufferLease:
        if size <= 0:
            raise ValueError("size must be positive")
        capacity = self._size_class(size)
        block = self._block if block is None else block
        timeout = self._default_timeout if timeout is None else timeout
        with self._condition:
            while True:
                if self._closing:
                    raise RuntimeError("buffer pool is closing")
                free = self._free.get(capacity)
                if free:
                    return BufferLease(self, free.pop(), size, capacity)
                if not self._max_bytes or self._allocated_bytes + capacity <= self._max_bytes:
                    return BufferLease(self, self._new_region(capacity), size, capacity)
                if not block or not self._condition.wait(timeout):
                    raise RuntimeError("buffer pool exhausted")

    def buffer(self, size: int, block=None, timeout=None) -> BufferLease:
        return self.acquire(size, block, timeout)

    def prewarm(self, size: int, count: int) -> None:
        leases = [self.acquire(size) for _ in range(count)]
        for lease in leases:
            lease.release()

    def _give_back(self, address: int, capacity: int) -> None:
        with self._condition:
            if address in self._regions:
                self._free.setdefault(capacity, []).append(address)
                self._condition.notify_all()

    def close(self) -> None:
        with self._condition:
            self._closing = True
            regions, self._regions = self._regions, {}
            self._free.clear()
            self._condition.notify_all()
        for address, region in regions.items():
            self._store.unregister_buffer(address)
            region.close()


# Mooncake's registered-buffer variants share the pool's implementation.
RegisteredBufferPool = BufferPool
RegisteredBufferLease = BufferLease
RegisteredBufferLeaseView = BufferLeaseView


class MooncakeDistributedNoFRegister:
    """NVMe-over-Fabrics segment registration: mooncaked has no NoF replicas."""

    def real_register(self, nqn: str = "", nsid: int = 1, traddr: str = "",
                      trsvcid: int = 4420, base: int = 0, size: int = 1024,
                      master_server_addr: str = "127.0.0.1:50051") -> int:
        return -1012  # NOT_SUPPORTED

    def real_unregister_by_endpoint(self, nqn: str = "", nsid: int = 1, traddr: str = "",
                                    trsvcid: int = 4420,
                                    master_server_addr: str = "127.0.0.1:50051") -> int:
        return -1012


class EngramStoreConfig:
    """Accepted so imports work; EngramStore (an embedding table store) is not provided."""

    def __init__(self, *args, **kwargs) -> None:
        self.args, self.kwargs = args, kwargs


class EngramStore:
    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError("EngramStore is not provided by mooncaked")


def bind_to_numa_node(node: int) -> None:
    """Mooncake pins the calling thread's memory to a NUMA node; a no-op here."""
    if not isinstance(node, int):
        raise TypeError("node must be an int")


def get_alloc_func_addr() -> int:
    """Mooncake's hugepage allocator for torch's pluggable allocator: none here (0)."""
    return 0


def get_free_func_addr() -> int:
    return 0


def _get_pyclient_from_wrapper(wrapper) -> None:
    """Mooncake hands EngramStore the C++ client; mooncaked has none to hand (None)."""
    return None


def _check_lengths(*sequences: Sequence) -> bool:
    return len({len(s) for s in sequences}) <= 1
