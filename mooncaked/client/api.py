"""The calls of a blocking client, written once for `BlockingClient` (one connection) and
`ClientPool` (many threads, a pool of connections).

A subclass supplies two ways to run a call:
- `_request(call, reads_only)`: one request (calls.py);
- `_operation(start, reads_only)`: a call of several requests (operations.py); `start` takes
  the connection that runs it and returns the operation.
`reads_only` says the call changes nothing, so the pool may send it again on a new connection
when the first was lost; a single connection ignores it.
"""

from __future__ import annotations

from typing import Sequence

from mooncaked.client import calls, operations
from mooncaked.client.calls import ReplicateConfig


class BlockingCalls:
    def _request(self, call: calls.Call, reads_only: bool):
        raise NotImplementedError

    def _operation(self, start, reads_only: bool):
        raise NotImplementedError

    def call(self, method: str, *params):
        """Any method of wire/PROTOCOL.md without a payload: its result (administration)."""
        return self._request(calls.simple(method, *params), False)

    # -- values -----------------------------------------------------------------------------

    def put(self, key: str, value, config: ReplicateConfig | None = None) -> bool:
        """Store a value; False if the key already existed (its value is kept)."""
        return self._operation(lambda c: operations.put(c, key, value, config), False)

    def upsert(self, key: str, value, config: ReplicateConfig | None = None) -> None:
        self._request(calls.upsert(key, value, config), False)

    def get(self, key: str) -> bytes:
        return self._operation(lambda c: operations.get(c, key), True)

    def get_into(self, key: str, buffer) -> int:
        """Receive a value into a writable buffer through the socket; returns its size."""
        return self._request(calls.get(key, into=buffer), True)

    def exists(self, key: str) -> bool:
        return self._request(calls.exists(key), True)

    def get_size(self, key: str) -> int:
        return self._request(calls.get_size(key), True)

    def remove(self, key: str, force: bool = False) -> None:
        self._request(calls.remove(key, force), False)

    def remove_by_regex(self, pattern: str, force: bool = False) -> int:
        return self._request(calls.remove_by_regex(pattern, force), False)

    def remove_all(self, force: bool = False) -> int:
        return self._request(calls.remove_all(force), False)

    def batch_put(self, keys: Sequence[str], values: Sequence,
                  config: ReplicateConfig | None = None) -> list[int]:
        return self._request(calls.batch_put(keys, values, config), False)

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        return self._request(calls.batch_get(keys), True)

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return self._request(calls.batch_exists(keys), True)

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        return self._request(calls.batch_remove(keys, force), False)

    def ping(self) -> str:
        return self._request(calls.simple("ping"), True)

    # -- values at raw addresses: shared memory when local ----------------------------------

    def put_from(self, key: str, address: int, size_bytes: int,
                 config: ReplicateConfig | None = None) -> bool:
        """Store `size_bytes` at `address` (this process's memory); False if the key existed."""
        return self._operation(
            lambda c: operations.put_from(c, key, address, size_bytes, config), False)

    def get_into_address(self, key: str, address: int, size_bytes: int) -> int:
        """Copy a value to `address` (room for `size_bytes`); returns the value's size."""
        return self._operation(
            lambda c: operations.get_into_address(c, key, address, size_bytes), True)

    def batch_put_from(self, keys: Sequence[str], addresses: Sequence[int],
                       sizes: Sequence[int], config: ReplicateConfig | None = None) -> list[int]:
        """Per key: 0 stored, 1 already existed, or a negative error code."""
        return self._operation(
            lambda c: operations.batch_put_from(c, keys, addresses, sizes, config), False)

    def batch_get_into(self, keys: Sequence[str], addresses: Sequence[int],
                       sizes: Sequence[int]) -> list[int]:
        """Per key: the value's size, or a negative error code."""
        return self._operation(
            lambda c: operations.batch_get_into(c, keys, addresses, sizes), True)

    def batch_put_from_ranges(self, keys: Sequence[str], sizes: Sequence[int],
                              ranges_per_key: Sequence[Sequence[operations.Range]],
                              config: ReplicateConfig | None = None) -> list[int]:
        """Per key, an object of `sizes[i]` bytes gathered from `(offset, address, size)`
        ranges; per key 0 stored, 1 already existed, or a negative error code."""
        return self._operation(lambda c: operations.batch_put_from_ranges(
            c, keys, sizes, ranges_per_key, config), False)

    def batch_get_into_ranges(self, keys: Sequence[str],
                              ranges_per_key: Sequence[Sequence[operations.Range]],
                              capacities: Sequence[int] | None = None) -> list[int]:
        """Per key, `(offset, address, size)` ranges of the value scattered to this process's
        memory (clipped at the value's end); per key the value's size or a negative code.
        With `capacities`, a value larger than its capacity is not copied (INVALID_PARAMS)."""
        return self._operation(lambda c: operations.batch_get_into_ranges(
            c, keys, ranges_per_key, capacities), True)

    # -- administration ---------------------------------------------------------------------

    def status(self) -> dict:
        return self._request(calls.simple("status"), True)

    def segment_report(self) -> list[dict]:
        return self._request(calls.simple("segments"), True)

    def objects_list(self, prefix: str = "", regex: str | None = None,
                     namespace: str | None = None, limit: int = 1000) -> list[dict]:
        return self._request(calls.simple("objects_list", prefix, regex, namespace, limit), True)

    def object_stat(self, key: str, namespace: str | None = None) -> dict:
        return self._request(calls.simple("object_stat", key, namespace), True)

    def config_show(self) -> dict:
        return self._request(calls.simple("config_show"), True)
