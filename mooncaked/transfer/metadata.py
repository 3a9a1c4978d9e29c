"""Where segment descriptors are found: Mooncake's metadata modes.

- P2P handshake (`"P2PHANDSHAKE"`): no store; a segment's name is `host:rpc_port` and its
  descriptor is fetched from it by a Metadata handshake (handshake.py).
- HTTP metadata server (`http://host:port/path`): a key-value store over HTTP, `GET`, `PUT`
  (JSON body) and `DELETE` of `<url>?key=<url-encoded key>`, 200 meaning success (404: no such
  key). A segment publishes `mooncake/rpc_meta/<name>` = {"ip_or_host_name", "rpc_port"} and
  `mooncake/ram/<name>` = its descriptor; its name is free-form.

The HTTP client here is a minimal HTTP/1.1 one on asyncio streams (one request per
connection), so that lookups run on the caller's loop.
"""

from __future__ import annotations

import asyncio
import json
import urllib.parse

DEFAULT_HTTP_TIMEOUT_MS = 3000  # Mooncake's client: 3 s a request
P2P_HANDSHAKE = "P2PHANDSHAKE"


class MetadataError(Exception):
    """The metadata server is unreachable, answered an error, or sent something unusable."""


def rpc_meta_key(segment: str) -> str:
    return f"mooncake/rpc_meta/{segment}"


def descriptor_key(segment: str) -> str:
    return f"mooncake/ram/{segment}"


class HttpMetadata:
    def __init__(self, url: str, *, timeout_ms: int = DEFAULT_HTTP_TIMEOUT_MS,
                 max_response_bytes: int = 1 << 20) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"metadata server {url!r}: only http://host[:port]/path is "
                             "supported")
        self.url = url
        self.host = parts.hostname
        self.port = parts.port or 80
        self.path = parts.path or "/"
        self.timeout_ms = timeout_ms
        self.max_response_bytes = max_response_bytes

    async def get(self, key: str) -> dict | None:
        """The JSON object under `key`, or None when the server has no such key."""
        status, body = await self._request("GET", key)
        if status == 404:
            return None
        if status != 200:
            raise MetadataError(f"GET {key}: HTTP {status}: {body[:200]!r}")
        try:
            value = json.loads(body)
        except ValueError as e:
            raise MetadataError(f"GET {key}: not JSON: {e}") from None
        if not isinstance(value, dict):
            raise MetadataError(f"GET {key}: not a JSON object")
        return value

    async def put(self, key: str, value: dict) -> None:
        status, body = await self._request("PUT", key, json.dumps(value).encode())
        if status != 200:
            raise MetadataError(f"PUT {key}: HTTP {status}: {body[:200]!r}")

    async def delete(self, key: str) -> None:
        status, body = await self._request("DELETE", key)
        if status not in (200, 404):
            raise MetadataError(f"DELETE {key}: HTTP {status}: {body[:200]!r}")

    async def _request(self, method: str, key: str, body: bytes = b"") -> tuple[int, bytes]:
        try:
            return await asyncio.wait_for(self._exchange(method, key, body),
                                          self.timeout_ms / 1000)
        except asyncio.TimeoutError:
            raise MetadataError(f"{method} {key}: no answer from {self.url} within "
                                f"{self.timeout_ms} ms") from None
        except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            raise MetadataError(f"{method} {key} at {self.url}: {e}") from None

    async def _exchange(self, method: str, key: str, body: bytes) -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            target = f"{self.path}?key={urllib.parse.quote(key, safe='')}"
            head = (f"{method} {target} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                    "Connection: close\r\n\r\n")
            writer.write(head.encode() + body)
            await writer.drain()
            status_line = await reader.readuntil(b"\r\n")
            parts = status_line.decode("latin-1").split(" ", 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
                raise MetadataError(f"{method} {key}: not an HTTP response: {status_line!r}")
            headers = {}
            while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            return int(parts[1]), await self._body(reader, headers)
        finally:
            writer.close()

    async def _body(self, reader: asyncio.StreamReader, headers: dict) -> bytes:
        limit = self.max_response_bytes
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if len(body) + size > limit:
                    raise MetadataError(f"response over {limit} bytes")
                body += (await reader.readexactly(size + 2))[:-2]
                if size == 0:
                    return body
        if "content-length" in headers:
            length = int(headers["content-length"])
            if length > limit:
                raise MetadataError(f"response of {length} bytes is over {limit}")
            return await reader.readexactly(length)
        body = await reader.read(limit + 1)
        if len(body) > limit:
            raise MetadataError(f"response over {limit} bytes")
        return body
