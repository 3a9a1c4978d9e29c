"""Mooncake Store's Python API over mooncaked, so an engine switches by changing an import:

    from mooncaked.mooncake_store import MooncakeDistributedStore, ReplicateConfig

Method names, argument order and return conventions follow `mooncake.store`'s
`MooncakeDistributedStore` for the calls engines make: ints are 0 or a negative Mooncake error
code, `get` of a missing key returns b"", `is_exist` returns 1 / 0, `get_into` returns the bytes
read. Differences, on purpose:
- `setup` connects to the local daemon instead of joining a cluster as a memory provider:
  `global_segment_size` is accepted and ignored (the daemon contributes the memory), as are the
  RDMA and metadata-server arguments. The daemon is found at `master_server_addr` when it is
  `unix:PATH`, `/PATH` or `HOST:PORT`, unless $MOONCAKED_ADDRESS names another address.
- `tenant_id` selects the mooncaked namespace.
- Zero-copy calls (`put_from`, `get_into`, batch forms) need the pointer inside a buffer given
  to `register_buffer`, as in Mooncake; the copy is one memcpy to or from the daemon's shared
  memory when connected over the Unix socket.
"""

from __future__ import annotations

import enum
import os
from typing import Sequence

from mooncaked.client import calls
from mooncaked.client.blocking import BlockingClient
from mooncaked.errors import ErrorCode, MooncakedError

_INVALID = int(ErrorCode.INVALID_PARAMS)


class SoftPinAction(enum.IntEnum):
    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ReplicateConfig:
    """Mooncake's ReplicateConfig: the fields engines set, with Mooncake's defaults."""

    def __init__(self) -> None:
        self.replica_num = 1
        self.soft_pin_action = SoftPinAction.PRESERVE
        self.soft_pin_ttl_ms: int | None = None
        self.with_hard_pin = False
        self.preferred_segments: list[str] = []
        self.preferred_segment = ""  # deprecated in Mooncake; when set, it replaces the list
        self.group_ids = None  # accepted, not used: a lifecycle hint in Mooncake

    @property
    def with_soft_pin(self) -> bool:
        return self.soft_pin_action == SoftPinAction.ENABLE

    @with_soft_pin.setter
    def with_soft_pin(self, value: bool) -> None:
        self.soft_pin_action = SoftPinAction.ENABLE if value else SoftPinAction.PRESERVE

    def to_client(self) -> calls.ReplicateConfig:
        if self.soft_pin_ttl_ms is not None and self.soft_pin_action != SoftPinAction.ENABLE:
            raise MooncakedError(ErrorCode.INVALID_PARAMS,
                                 "soft_pin_ttl_ms is valid only with SoftPinAction.ENABLE")
        preferred = [self.preferred_segment] if self.preferred_segment else \
            list(self.preferred_segments)
        return calls.ReplicateConfig(
            replica_num=self.replica_num, preferred_segments=preferred,
            with_soft_pin=self.soft_pin_action == SoftPinAction.ENABLE,
            soft_pin_ttl_ms=self.soft_pin_ttl_ms, with_hard_pin=self.with_hard_pin)


def _config(config: ReplicateConfig | None) -> calls.ReplicateConfig | None:
    return None if config is None else config.to_client()


def _parse_size(value) -> int:
    """Mooncake's setup(dict) accepts ints and strings such as "16MB" / "16 MB"."""
    if isinstance(value, int):
        return value
    text = str(value).strip().upper().replace(" ", "")
    units = {"TB": 1 << 40, "GB": 1 << 30, "MB": 1 << 20, "KB": 1 << 10, "B": 1}
    for unit, factor in units.items():
        if text.endswith(unit) and text[:-len(unit)].replace(".", "", 1).isdigit():
            return int(float(text[:-len(unit)]) * factor)
    if text.isdigit():
        return int(text)
    raise ValueError(f"not a size: {value!r}")


class MooncakeDistributedStore:
    def __init__(self) -> None:
        self._client: BlockingClient | None = None
        self._hostname = ""
        self._local_buffer_size = 0
        self._buffers: dict[int, int] = {}  # registered buffer start -> size

    # -- set-up -----------------------------------------------------------------------------

    def setup(self, local_hostname, metadata_server: str = "", global_segment_size: int = 0,
              local_buffer_size: int = 16 << 20, protocol: str = "tcp", rdma_devices: str = "",
              master_server_addr: str = "127.0.0.1:50051", engine=None, **options) -> int:
        if isinstance(local_hostname, dict):
            settings = dict(local_hostname)
            return self.setup(
                settings.pop("local_hostname"), settings.pop("metadata_server", ""),
                _parse_size(settings.pop("global_segment_size", 16 << 20)),
                _parse_size(settings.pop("local_buffer_size", 16 << 20)),
                settings.pop("protocol", "tcp"),
                settings.pop("rdma_devices", settings.pop("device_name", "")),
                settings.pop("master_server_addr",
                             settings.pop("master_server_address", "127.0.0.1:50051")),
                **settings)
        address = os.environ.get("MOONCAKED_ADDRESS") or options.get("mooncaked_address") \
            or master_server_addr
        try:
            self.close()
            self._client = BlockingClient.connect(
                address, namespace=options.get("tenant_id", "default") or "default",
                client_name=f"mooncake-store:{local_hostname}")
        except (OSError, ValueError) as exc:
            self._client = None
            return int(ErrorCode.RPC_FAIL) if isinstance(exc, OSError) else _INVALID
        except MooncakedError as exc:
            return exc.code
        self._hostname = str(local_hostname)
        self._local_buffer_size = local_buffer_size
        return 0

    def get_hostname(self) -> str:
        return self._hostname

    def health_check(self) -> int:
        if self._client is None:
            return 1
        try:
            self._client.ping()
        except MooncakedError:
            return 2
        return 0

    def close(self) -> int:
        if self._client is not None:
            self._client.close()
            self._client = None
        self._buffers.clear()
        return 0

    def _call(self, function, *args) -> int:
        """Run a client call that returns nothing useful: 0, or the error's code."""
        if self._client is None:
            return int(ErrorCode.RPC_FAIL)
        try:
            function(*args)
        except MooncakedError as exc:
            return exc.code
        return 0

    # -- buffers ----------------------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        if buffer_ptr <= 0 or size <= 0:
            return _INVALID
        self._buffers[buffer_ptr] = size
        return 0

    def unregister_buffer(self, buffer_ptr: int) -> int:
        return 0 if self._buffers.pop(buffer_ptr, None) is not None else _INVALID

    def _registered(self, ptr: int, size: int) -> bool:
        return any(start <= ptr and ptr + size <= start + length
                   for start, length in self._buffers.items())

    # -- values -----------------------------------------------------------------------------

    def put(self, key: str, value, config: ReplicateConfig | None = None) -> int:
        size = memoryview(value).nbytes
        if size == 0 or size > self._local_buffer_size:
            return _INVALID  # Mooncake stages values in the local buffer
        return self._call(lambda: self._client.put(key, value, _config(config)))

    def put_parts(self, key: str, *parts, config: ReplicateConfig | None = None) -> int:
        return self.put(key, b"".join(bytes(p) for p in parts), config)

    def upsert(self, key: str, value, config: ReplicateConfig | None = None) -> int:
        size = memoryview(value).nbytes
        if size == 0 or size > self._local_buffer_size:
            return _INVALID
        return self._call(lambda: self._client.upsert(key, value, _config(config)))

    def put_batch(self, keys: Sequence[str], values: Sequence,
                  config: ReplicateConfig | None = None) -> int:
        if self._client is None:
            return int(ErrorCode.RPC_FAIL)
        try:
            codes = self._client.batch_put(keys, values, _config(config))
        except MooncakedError as exc:
            return exc.code
        failed = [code for code in codes if code < 0]
        return failed[0] if failed else 0

    def get(self, key: str) -> bytes:
        if self._client is None:
            return b""
        try:
            return self._client.get(key)
        except MooncakedError:
            return b""

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        if self._client is None:
            return [b"" for _ in keys]
        try:
            return [value or b"" for value in self._client.batch_get(keys)]
        except MooncakedError:
            return [b"" for _ in keys]

    def put_from(self, key: str, buffer_ptr: int, size: int,
                 config: ReplicateConfig | None = None) -> int:
        if size <= 0 or not self._registered(buffer_ptr, size):
            return _INVALID
        return self._call(lambda: self._client.put_from(key, buffer_ptr, size, _config(config)))

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        if size <= 0 or not self._registered(buffer_ptr, size):
            return _INVALID
        if self._client is None:
            return int(ErrorCode.RPC_FAIL)
        try:
            return self._client.get_into_address(key, buffer_ptr, size)
        except MooncakedError as exc:
            return exc.code

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int], config: ReplicateConfig | None = None) -> list[int]:
        results = self._registered_batch(
            keys, buffer_ptrs, sizes,
            lambda k, p, s: self._client.batch_put_from(k, p, s, _config(config)))
        return [0 if code == 1 else code for code in results]  # an existing key: success

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int]) -> list[int]:
        return self._registered_batch(
            keys, buffer_ptrs, sizes, lambda k, p, s: self._client.batch_get_into(k, p, s))

    def _registered_batch(self, keys, buffer_ptrs, sizes, run) -> list[int]:
        """Run a batch call on the keys whose range lies in a registered buffer; the others
        get INVALID_PARAMS, as in Mooncake."""
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [_INVALID] * len(keys)
        if self._client is None:
            return [int(ErrorCode.RPC_FAIL)] * len(keys)
        valid = [i for i, (p, s) in enumerate(zip(buffer_ptrs, sizes))
                 if s > 0 and self._registered(p, s)]
        results = [_INVALID] * len(keys)
        try:
            done = run([keys[i] for i in valid], [buffer_ptrs[i] for i in valid],
                       [sizes[i] for i in valid])
        except MooncakedError as exc:
            done = [exc.code] * len(valid)
        for i, result in zip(valid, done):
            results[i] = result
        return results

    # -- queries and removal ----------------------------------------------------------------

    def is_exist(self, key: str) -> int:
        if self._client is None:
            return int(ErrorCode.RPC_FAIL)
        try:
            return 1 if self._client.exists(key) else 0
        except MooncakedError as exc:
            return exc.code

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        if not keys:
            return []
        if self._client is None:
            return [int(ErrorCode.RPC_FAIL)] * len(keys)
        try:
            return [1 if found else 0 for found in self._client.batch_exists(keys)]
        except MooncakedError as exc:
            return [exc.code] * len(keys)

    def get_size(self, key: str) -> int:
        if self._client is None:
            return int(ErrorCode.RPC_FAIL)
        try:
            return self._client.get_size(key)
        except MooncakedError as exc:
            return exc.code

    def remove(self, key: str, force: bool = False) -> int:
        return self._call(lambda: self._client.remove(key, force))

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        if self._client is None:
            return [int(ErrorCode.RPC_FAIL)] * len(keys)
        try:
            return self._client.batch_remove(keys, force)
        except MooncakedError as exc:
            return [exc.code] * len(keys)

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        if self._client is None:
            return int(ErrorCode.RPC_FAIL)
        try:
            return self._client.remove_by_regex(regex_pattern, force)
        except MooncakedError as exc:
            return exc.code

    def remove_all(self, force: bool = False) -> int:
        if self._client is None:
            return int(ErrorCode.RPC_FAIL)
        try:
            return self._client.remove_all(force)
        except MooncakedError as exc:
            return exc.code


__all__ = ["MooncakeDistributedStore", "ReplicateConfig", "SoftPinAction"]
