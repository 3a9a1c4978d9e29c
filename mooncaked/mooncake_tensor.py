"""Tensors in Mooncake Store's object layout: [TensorMetadata (304 bytes)][tensor data].

The metadata is Mooncake's little-endian C struct, so an object written by `put_tensor` here
has the bytes Mooncake writes, and buffers for `put_tensor_from` / `get_tensor_into` are
interchangeable with Mooncake's:

    header (40 bytes): magic u32 "MOON", version u16 = 1, header_size u16 = 304, dtype i32,
        ndim i32, layout_kind u32 (0 full, 1 shard), reserved_flags u32, data_offset u64 = 304,
        data_bytes u64
    layout (264 bytes): global_shape i64[8], local_shape i64[8] (unused dims -1),
        axis_count u32, reserved u32, 4 axes of (kind, axis_index, shard_rank, shard_count,
        split_dim, reserved0: i32; reserved1: i64)

torch is optional: it is imported on first use, and a tensor call without it raises
ImportError saying how to install it.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass, field

TENSOR_MAGIC = 0x4D4F4F4E  # "NOOM" little-endian: the bytes read "MOON" backwards
TENSOR_VERSION = 1
MAX_DIMS = 8
MAX_AXES = 4
LAYOUT_FULL, LAYOUT_SHARD = 0, 1
AXIS_KINDS = {"dp": 0, "tp": 1, "ep": 2, "pp": 3}

_HEADER = struct.Struct("<IHHiiIIQQ")
_SHAPE = struct.Struct(f"<{MAX_DIMS}q")
_AXES_HEAD = struct.Struct("<II")
_AXIS = struct.Struct("<iiiiiiq")
METADATA_SIZE = _HEADER.size + 2 * _SHAPE.size + _AXES_HEAD.size + MAX_AXES * _AXIS.size
assert METADATA_SIZE == 304

# Mooncake's dtype numbers, by torch dtype name, with the element size in bytes.
DTYPES = {
    "float32": (0, 4), "float64": (1, 8), "int8": (2, 1), "uint8": (3, 1), "int16": (4, 2),
    "uint16": (5, 2), "int32": (6, 4), "uint32": (7, 4), "int64": (8, 8), "uint64": (9, 8),
    "bool": (10, 1), "float16": (11, 2), "bfloat16": (12, 2), "float8_e4m3fn": (13, 1),
    "float8_e5m2": (14, 1),
}
_DTYPE_NAMES = {code: name for name, (code, _size) in DTYPES.items()}
_ELEMENT_SIZES = {code: size for _name, (code, size) in DTYPES.items()}


def torch_module():
    try:
        import torch
    except ImportError as exc:
        raise ImportError("the tensor calls of mooncaked.mooncake_store need PyTorch: "
                          "pip install 'mooncaked[torch]' (or torch itself)") from exc
    return torch


@dataclass
class Axis:
    kind: int
    axis_index: int
    shard_rank: int
    shard_count: int
    split_dim: int = -1
    reserved0: int = 0  # expert id (ep) or stage id (pp)
    reserved1: int = 0  # the shard's extent along split_dim


@dataclass
class TensorMetadata:
    dtype: int
    global_shape: list[int]
    local_shape: list[int]
    layout_kind: int = LAYOUT_FULL
    data_bytes: int = 0
    axes: list[Axis] = field(default_factory=list)
    data_offset: int = METADATA_SIZE

    def pack(self) -> bytes:
        def shape(dims):
            return _SHAPE.pack(*(list(dims) + [-1] * (MAX_DIMS - len(dims))))
        axes = b"".join(_AXIS.pack(a.kind, a.axis_index, a.shard_rank, a.shard_count,
                                   a.split_dim, a.reserved0, a.reserved1) for a in self.axes)
        axes += bytes(_AXIS.size * (MAX_AXES - len(self.axes)))
        return (_HEADER.pack(TENSOR_MAGIC, TENSOR_VERSION, METADATA_SIZE, self.dtype,
                             len(self.global_shape), self.layout_kind, 0, self.data_offset,
                             self.data_bytes)
                + shape(self.global_shape) + shape(self.local_shape)
                + _AXES_HEAD.pack(len(self.axes), 0) + axes)

    @property
    def torch_dtype(self):
        return getattr(torch_module(), _DTYPE_NAMES[self.dtype])


def parse_metadata(data, total_length: int) -> TensorMetadata | None:
    """The metadata at the start of an object of `total_length` bytes, or None when it is not
    a valid Mooncake tensor object (Mooncake's checks: magic, version, sizes, shapes)."""
    if total_length < METADATA_SIZE or len(data) < METADATA_SIZE:
        return None
    (magic, version, header_size, dtype, ndim, layout_kind, _flags, data_offset,
     data_bytes) = _HEADER.unpack_from(data, 0)
    if (magic != TENSOR_MAGIC or version != TENSOR_VERSION or header_size != METADATA_SIZE
            or dtype not in _ELEMENT_SIZES or not 0 <= ndim <= MAX_DIMS
            or layout_kind > LAYOUT_SHARD or not METADATA_SIZE <= data_offset <= total_length
            or data_bytes != total_length - data_offset):
        return None
    global_dims = _SHAPE.unpack_from(data, _HEADER.size)
    local_dims = _SHAPE.unpack_from(data, _HEADER.size + _SHAPE.size)
    axis_count, _reserved = _AXES_HEAD.unpack_from(data, _HEADER.size + 2 * _SHAPE.size)
    if axis_count > MAX_AXES:
        return None
    if any(d < 0 for d in global_dims[:ndim] + local_dims[:ndim]):
        return None
    if any(d != -1 for d in global_dims[ndim:] + local_dims[ndim:]):
        return None
    numel = 1
    for d in local_dims[:ndim]:
        numel *= d
    if numel * _ELEMENT_SIZES[dtype] != data_bytes:
        return None
    axes = []
    start = _HEADER.size + 2 * _SHAPE.size + _AXES_HEAD.size
    for i in range(axis_count):
        axis = Axis(*_AXIS.unpack_from(data, start + i * _AXIS.size))
        if not (0 <= axis.kind <= 4 and 0 <= axis.shard_rank < axis.shard_count
                and -1 <= axis.split_dim < ndim):
            return None
        axes.append(axis)
    return TensorMetadata(dtype, list(global_dims[:ndim]), list(local_dims[:ndim]),
                          layout_kind, data_bytes, axes, data_offset)


def dtype_code(tensor) -> int | None:
    name = str(tensor.dtype).removeprefix("torch.")
    entry = DTYPES.get(name)
    return None if entry is None else entry[0]


@dataclass
class TensorInfo:
    """A tensor ready to store: its metadata, and its contiguous CPU bytes at data_ptr."""
    metadata: TensorMetadata
    data_ptr: int
    size: int
    owner: object  # keeps the memory at data_ptr alive


def tensor_info(tensor, global_shape=None, axes=None) -> TensorInfo | None:
    """Inspect a torch tensor (copied to contiguous CPU memory when it is not); None for an
    object that is not a tensor of a dtype Mooncake stores, or with more than 8 dims."""
    if "Tensor" not in type(tensor).__name__:
        return None
    code = dtype_code(tensor)
    if code is None or tensor.dim() > MAX_DIMS:
        return None
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    tensor = tensor.contiguous()
    size = tensor.numel() * tensor.element_size()
    local_shape = list(tensor.shape)
    metadata = TensorMetadata(
        code, list(global_shape) if global_shape is not None else local_shape, local_shape,
        LAYOUT_SHARD if axes else LAYOUT_FULL, size, list(axes or []))
    return TensorInfo(metadata, tensor.data_ptr() if size else 0, size, tensor)


def tensor_bytes(info: TensorInfo) -> bytes:
    """The object Mooncake stores for a tensor: metadata then data."""
    return info.metadata.pack() + (ctypes.string_at(info.data_ptr, info.size)
                                   if info.size else b"")


def _result_shape(metadata: TensorMetadata) -> list[int]:
    """Mooncake hands back a 0-dim tensor as shape [1]; so do we, for the same results."""
    return metadata.local_shape or [1]


def tensor_from_object(data) -> object | None:
    """A tensor (owning a copy of the bytes) from a stored object, or None if it is not one."""
    view = memoryview(data).cast("B")
    metadata = parse_metadata(view, view.nbytes)
    if metadata is None:
        return None
    torch = torch_module()
    if metadata.data_bytes == 0:
        return torch.empty(metadata.local_shape, dtype=metadata.torch_dtype)
    payload = bytearray(view[metadata.data_offset:])
    return torch.frombuffer(payload, dtype=metadata.torch_dtype).reshape(_result_shape(metadata))


def tensor_at(address: int, total_length: int) -> object | None:
    """A tensor viewing an object already copied to `address` (no copy), or None."""
    if total_length < METADATA_SIZE:
        return None
    metadata = parse_metadata(ctypes.string_at(address, METADATA_SIZE), total_length)
    if metadata is None:
        return None
    torch = torch_module()
    if metadata.data_bytes == 0:
        return torch.empty(metadata.local_shape, dtype=metadata.torch_dtype)
    array = (ctypes.c_char * metadata.data_bytes).from_address(address + metadata.data_offset)
    return torch.frombuffer(array, dtype=metadata.torch_dtype).reshape(_result_shape(metadata))


def tp_shards(tensor, tp_size: int, split_dim: int) -> list[TensorInfo] | None:
    """The tp_size equal shards of a tensor along split_dim, each with Mooncake's shard
    metadata (one "tp" axis); None when the dim does not divide evenly."""
    if "Tensor" not in type(tensor).__name__ or tp_size <= 0:
        return None
    if not 0 <= split_dim < tensor.dim() or tensor.shape[split_dim] % tp_size:
        return None
    global_shape = list(tensor.shape)
    shards = []
    for rank, shard in enumerate(tensor.chunk(tp_size, split_dim)):
        axis = Axis(AXIS_KINDS["tp"], 0, rank, tp_size, split_dim, 0, shard.shape[split_dim])
        info = tensor_info(shard, global_shape, [axis])
        if info is None:
            return None
        shards.append(info)
    return shards


# -- safetensors files (the format: u64 header length, JSON header, data) --------------------

_SAFETENSORS_DTYPES = {
    "float32": "F32", "float64": "F64", "int8": "I8", "uint8": "U8", "int16": "I16",
    "uint16": "U16", "int32": "I32", "uint32": "U32", "int64": "I64", "uint64": "U64",
    "bool": "BOOL", "float16": "F16", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


def write_safetensors(path: str, name: str, tensor) -> None:
    import json
    info = tensor_info(tensor)
    if info is None:
        raise ValueError("not a storable tensor")
    dtype_name = str(tensor.dtype).removeprefix("torch.")
    header = json.dumps({name: {"dtype": _SAFETENSORS_DTYPES[dtype_name],
                                "shape": info.metadata.local_shape,
                                "data_offsets": [0, info.size]}}).encode()
    header += b" " * (-len(header) % 8)  # the format pads the header to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        if info.size:
            f.write(ctypes.string_at(info.data_ptr, info.size))


def read_safetensors(path: str, name: str | None):
    """(the tensor called `name`, or the first one in the file, its name)."""
    import json
    with open(path, "rb") as f:
        (header_length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_length))
        data = f.read()
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    if not entries:
        raise ValueError(f"{path}: no tensor in the file")
    chosen = name if name in entries else next(iter(entries))
    entry = entries[chosen]
    by_safetensors_name = {v: k for k, v in _SAFETENSORS_DTYPES.items()}
    torch = torch_module()
    dtype = getattr(torch, by_safetensors_name[entry["dtype"]])
    start, end = entry["data_offsets"]
    if end == start:
        return torch.empty(entry["shape"], dtype=dtype), chosen
    tensor = torch.frombuffer(bytearray(data[start:end]), dtype=dtype).reshape(entry["shape"])
    return tensor, chosen
