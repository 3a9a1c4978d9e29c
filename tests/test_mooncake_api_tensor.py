"""Tensor calls in Mooncake's object layout ([TensorMetadata][data]): the bytes match what
the real mooncake.store 0.3.13 `_serialize_tensor` produced (tests/data/
mooncake_tensor_vectors.json), and put_tensor / get / get_tensor_into / put_tensor_from agree
with each other on a real daemon."""

from __future__ import annotations

import ctypes
import json
import os

import pytest

torch = pytest.importorskip("torch")

from mooncaked.mooncake_store import (MooncakeDistributedStore, ReadTarget, ReplicateConfig,
                                      TensorParallelism, _deserialize_tensor,
                                      _serialize_tensor)

VECTORS = json.load(open(os.path.join(os.path.dirname(__file__), "data",
                                      "mooncake_tensor_vectors.json")))
INVALID, NOT_FOUND, NOT_SUPPORTED = -600, -704, -1012

CASES = {
    "f32_2x3": lambda: torch.arange(6, dtype=torch.float32).reshape(2, 3),
    "bf16_4": lambda: torch.arange(4, dtype=torch.bfloat16),
    "i64_scalar": lambda: torch.tensor(7, dtype=torch.int64),
    "bool_3x1x2": lambda: torch.tensor([[[True, False]], [[False, True]], [[True, True]]]),
    "u8_empty": lambda: torch.empty(0, 5, dtype=torch.uint8),
    "f16_noncontig": lambda: torch.arange(12, dtype=torch.float16).reshape(3, 4).t(),
    "f8": lambda: torch.zeros(3, dtype=torch.float8_e4m3fn),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_serialization_matches_mooncake(name):
    tensor = CASES[name]()
    metadata, data_ptr, size, owner = _serialize_tensor(tensor)
    data = ctypes.string_at(data_ptr, size) if size else b""
    assert (metadata + data).hex() == VECTORS["objects"][name]
    back = _deserialize_tensor(bytes.fromhex(VECTORS["objects"][name]))
    shape, dtype, values = VECTORS["deserialized"][name]
    assert list(back.shape) == shape and str(back.dtype) == dtype
    assert back.float().flatten().tolist() == values


def test_serialization_refuses_bad_input():
    with pytest.raises(ValueError):
        _serialize_tensor(b"not a tensor")
    with pytest.raises(ValueError):
        _serialize_tensor(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError):
        _deserialize_tensor(b"\0" * 400)


@pytest.fixture
def store(daemon):
    store = MooncakeDistributedStore()
    assert store.setup("localhost", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "",
                       daemon.unix_address) == 0
    yield store
    store.close()


def test_put_tensor_bytes_are_mooncakes(store):
    tensor = CASES["f32_2x3"]()
    assert store.put_tensor("t", tensor) == 0
    assert store.get("t").hex() == VECTORS["objects"]["f32_2x3"]
    assert torch.equal(store.get_tensor("t"), tensor)
    assert store.get_tensor("missing") is None
    assert store.put("raw", b"not a tensor") == 0
    assert store.get_tensor("raw") is None
    assert store.put_tensor("bad", "not a tensor") == INVALID
    assert store.upsert_tensor("t", tensor * 2) == 0
    assert torch.equal(store.get_tensor("t"), tensor * 2)


def test_batches_pub_and_upsert(store):
    tensors = [torch.randn(4, 8), torch.arange(10, dtype=torch.int32)]
    assert store.batch_put_tensor(["a", "b"], tensors) == [0, 0]
    got = store.batch_get_tensor(["a", "b", "c"])
    assert torch.equal(got[0], tensors[0]) and torch.equal(got[1], tensors[1]) and got[2] is None
    config = ReplicateConfig()
    config.replica_num = 1
    assert store.pub_tensor("p", tensors[0], config) == 0
    assert store.batch_pub_tensor(["p2"], [tensors[1]], config) == [0]
    assert store.upsert_pub_tensor("p", tensors[1], config) == 0
    assert store.batch_upsert_pub_tensor(["p2"], [tensors[0]], config) == [0]
    assert store.batch_upsert_tensor(["a"], [tensors[1]]) == [0]
    assert torch.equal(store.get_tensor("p"), tensors[1])
    assert torch.equal(store.get_tensor("p2"), tensors[0])
    assert torch.equal(store.get_tensor("a"), tensors[1])
    assert store.batch_put_tensor(["x"], []) == [INVALID]


def test_tensor_into_and_from_buffers(store):
    size = 1 << 16
    buffer = ctypes.create_string_buffer(size)
    base = ctypes.addressof(buffer)
    assert store.register_buffer(base, size) == 0
    tensor = torch.randn(16, 16)
    assert store.put_tensor("t", tensor) == 0
    view = store.get_tensor_into("t", base, size)
    assert torch.equal(view, tensor)
    assert view.data_ptr() == base + 304  # a view of the buffer, no copy
    # The same buffer, as Mooncake lays it out, stores a tensor as it is.
    assert store.put_tensor_from("copy", base, 304 + tensor.numel() * 4) == 0
    assert store.get("copy") == store.get("t")
    assert store.put_tensor_from("bad", base, 100) == INVALID
    assert store.batch_put_tensor_from(["c2", "bad"], [base, base], [304 + 1024, 300]) \
        == [0, INVALID]
    assert store.upsert_tensor_from("copy", base, 304 + 1024) == 0
    assert store.batch_upsert_tensor_from(["copy"], [base], [304 + 1024]) == [0]
    got = store.batch_get_tensor_into(["t", "missing"], [base, base + 32768], [32768, 1024])
    assert torch.equal(got[0], tensor) and got[1] is None
    assert store.get_tensor_into("t", base, 500) is None  # too small


def test_tensor_parallel_shards(store):
    tensor = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    assert store.put_tensor_with_tp("w", tensor, tp_size=3, split_dim=1) == 0
    for rank in range(3):
        shard = store.get_tensor_with_tp("w", tp_rank=rank, tp_size=3, split_dim=1)
        assert torch.equal(shard, tensor[:, 2 * rank:2 * rank + 2])
        assert torch.equal(store.get_tensor(f"w_tp_{rank}"), shard)
    assert store.put_tensor_with_tp("odd", tensor, tp_size=5) == INVALID  # 4 rows, 5 ranks
    assert store.batch_put_tensor_with_tp(["b1", "b2"], [tensor, tensor], tp_size=2) == [0, 0]
    shards = store.batch_get_tensor_with_tp(["b1", "b2"], tp_rank=1, tp_size=2)
    assert all(torch.equal(s, tensor[2:]) for s in shards)
    config = ReplicateConfig()
    assert store.pub_tensor_with_tp("pub", tensor, config, 0, 2, 0) == 0
    assert store.batch_pub_tensor_with_tp(["pub2"], [tensor], config, tp_size=2) == [0]
    assert torch.equal(store.get_tensor_with_tp("pub2", 0, 2), tensor[:2])
    # tp_size 1: the whole tensor under the key itself.
    assert store.put_tensor_with_tp("whole", tensor) == 0
    assert torch.equal(store.get_tensor("whole"), tensor)
    # From a [TensorMetadata][data] buffer.
    size = 1 << 14
    buffer = ctypes.create_string_buffer(size)
    base = ctypes.addressof(buffer)
    assert store.register_buffer(base, size) == 0
    assert store.get_tensor_into("whole", base, size) is not None
    assert store.put_tensor_with_tp_from("fromb", base, 304 + 96, tp_size=2) == 0
    assert torch.equal(store.get_tensor("fromb_tp_1"), tensor[2:])
    into = store.get_tensor_with_tp_into("fromb", base + 4096, 4096, tp_rank=0, tp_size=2)
    assert torch.equal(into, tensor[:2])
    assert torch.equal(store.batch_get_tensor_with_tp_into(
        ["fromb"], [base + 8192], [4096], tp_rank=1, tp_size=2)[0], tensor[2:])


def test_parallelism_forms(store):
    tensor = torch.ones(2, 2)
    assert store.put_tensor_with_parallelism("plain", tensor) == 0
    assert torch.equal(store.get_tensor_with_parallelism("plain"), tensor)
    assert torch.equal(store.get_tensor_with_parallelism("plain", ReadTarget()), tensor)
    assert store.put_tensor_with_parallelism("p", tensor, TensorParallelism()) == NOT_SUPPORTED
    target = ReadTarget()
    target.mode = "full"
    assert store.get_tensor_with_parallelism("plain", target) is None
    assert store.batch_put_tensor_with_parallelism(["q"], [tensor]) == [0]
    assert store.batch_upsert_tensor_with_parallelism(["q"], [tensor * 3]) == [0]
    assert torch.equal(store.batch_get_tensor_with_parallelism(["q"])[0], tensor * 3)


def test_into_cuda_form_on_cpu_tensors(store):
    tensor = torch.randn(3, 3)
    assert store.put_tensor("t", tensor) == 0
    target = torch.empty(3, 3)
    assert store.get_tensor_into_cuda("t", target) == 36
    assert torch.equal(target, tensor)
    assert store.batch_get_tensor_into_cuda(["t", "none"], [torch.empty(2), torch.empty(1)]) \
        == [INVALID, NOT_FOUND]


def test_safetensors_round_trip(store, tmp_path):
    tensor = torch.randn(5, 7).to(torch.bfloat16)
    assert store.put_tensor("weights", tensor) == 0
    path = str(tmp_path / "w.safetensors")
    assert store.save_tensor_to_safetensor("weights", path) == 0
    assert store.save_tensor_to_safetensor("missing", path + ".x") == NOT_FOUND
    loaded = store.load_tensor_from_safetensor("weights-copy", path)  # not in file: first one
    assert torch.equal(loaded, tensor)
    assert torch.equal(store.get_tensor("weights-copy"), tensor)
    assert torch.equal(store.load_tensor_from_safetensor(file_name=path), tensor)
    assert torch.equal(store.get_tensor(path), tensor)  # the file name is the key
    assert store.load_tensor_from_safetensor("k", str(tmp_path / "none")) is None
    safetensors = pytest.importorskip("safetensors.torch")
    assert torch.equal(safetensors.load_file(path)["weights"], tensor)
