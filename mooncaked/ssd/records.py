"""The disk tier's on-disk blocks: region headers and record headers.

A region starts with one region header block; records follow, each one header block and then
its value padded to whole blocks. All integers are little-endian. A header is valid only when
its magic, format version and CRC32C (over the header with its crc field zeroed, and for a
record the namespace and key bytes after it) are right; the rest of the block is zero.

Region header (40 bytes): magic "MCSSDRGN", format u16, flags u16 (FREE 1: erased by
reclaim, no records), region index u32, instance id u64, sequence u64, crc u32, 0 u32.
Sequences grow over the tier's life and are never reused: a region's body keeps the records
of its earlier uses, and only the sequence tells them apart.

Record header (48 bytes + namespace + key): magic "MCSSDREC", format u16, flags u16
(LIVE 1, DEAD 2), namespace length u16, key length u16, region sequence u64, value size u64,
object version u64, value crc32c u32, header crc u32; then the namespace and key (UTF-8).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from mooncaked._native import crc32c

FORMAT_VERSION = 1
REGION_MAGIC = b"MCSSDRGN"
RECORD_MAGIC = b"MCSSDREC"
FLAG_LIVE = 1
FLAG_DEAD = 2
REGION_FLAG_FREE = 1

_REGION = struct.Struct("<8sHHIQQII")
_RECORD = struct.Struct("<8sHHHHQQQII")
RECORD_HEADER_BYTES = _RECORD.size  # namespace + key must fit the block after this
_RECORD_CRC_AT = _RECORD.size - 4


@dataclass(frozen=True)
class RegionHeader:
    region: int
    instance_id: int
    sequence: int
    free: bool = False   # written by reclaim: the region holds no records


@dataclass(frozen=True)
class RecordHeader:
    flags: int
    namespace: str
    key: str
    sequence: int
    size_bytes: int
    version: int
    value_crc: int


def pad_to_block(size_bytes: int, block_bytes: int) -> int:
    return -(-size_bytes // block_bytes) * block_bytes


def record_bytes(size_bytes: int, block_bytes: int) -> int:
    """Disk space of a record: its header block and its value padded to blocks."""
    return block_bytes + pad_to_block(size_bytes, block_bytes)


def key_fits(namespace: bytes, key: bytes, block_bytes: int) -> bool:
    return (len(namespace) <= 0xFFFF and len(key) <= 0xFFFF
            and RECORD_HEADER_BYTES + len(namespace) + len(key) <= block_bytes)


def encode_region_header(block: memoryview, header: RegionHeader) -> None:
    """Write a region header into `block` (one block, zeroed around it)."""
    block[:] = bytes(len(block))
    _REGION.pack_into(block, 0, REGION_MAGIC, FORMAT_VERSION,
                      REGION_FLAG_FREE if header.free else 0, header.region,
                      header.instance_id, header.sequence, 0, 0)
    crc = crc32c(block[:_REGION.size])
    struct.pack_into("<I", block, _REGION.size - 8, crc)


def decode_region_header(block) -> RegionHeader | None:
    """The region header in `block`, or None when the block holds none (never used since
    the format, or torn)."""
    magic, version, flags, region, instance_id, sequence, crc, _ = _REGION.unpack_from(block, 0)
    if magic != REGION_MAGIC or version != FORMAT_VERSION or flags & ~REGION_FLAG_FREE:
        return None
    check = bytearray(block[:_REGION.size])
    struct.pack_into("<I", check, _REGION.size - 8, 0)
    if crc32c(check) != crc:
        return None
    return RegionHeader(region, instance_id, sequence, bool(flags & REGION_FLAG_FREE))


def encode_record_header(block: memoryview, header: RecordHeader) -> None:
    """Write a record header into `block` (one block; the bytes after the key are zeroed)."""
    namespace = header.namespace.encode()
    key = header.key.encode()
    end = RECORD_HEADER_BYTES + len(namespace) + len(key)
    if end > len(block):
        raise ValueError("namespace and key do not fit a record header block")
    _RECORD.pack_into(block, 0, RECORD_MAGIC, FORMAT_VERSION, header.flags, len(namespace),
                      len(key), header.sequence, header.size_bytes, header.version,
                      header.value_crc, 0)
    block[RECORD_HEADER_BYTES:end] = namespace + key
    block[end:] = bytes(len(block) - end)
    struct.pack_into("<I", block, _RECORD_CRC_AT, crc32c(block[:end]))


class TornHeader(Exception):
    """A record header of the region's sequence that is only partly there."""


def decode_record_header(block, sequence: int) -> RecordHeader | None:
    """The record header in `block` if it is one of the region whose sequence is given;
    None when the block is not (zeros, value bytes, a header of an earlier use of the
    region); TornHeader when the magic is there but the header does not check out."""
    (magic, version, flags, namespace_length, key_length, record_sequence, size_bytes,
     object_version, value_crc, crc) = _RECORD.unpack_from(block, 0)
    if magic != RECORD_MAGIC:
        return None
    end = RECORD_HEADER_BYTES + namespace_length + key_length
    if version != FORMAT_VERSION or end > len(block) or flags not in (FLAG_LIVE, FLAG_DEAD):
        raise TornHeader()
    check = bytearray(block[:end])
    struct.pack_into("<I", check, _RECORD_CRC_AT, 0)
    if crc32c(check) != crc:
        raise TornHeader()
    if record_sequence != sequence:
        return None  # intact, but written in an earlier use of the region
    try:
        namespace = bytes(check[RECORD_HEADER_BYTES:RECORD_HEADER_BYTES + namespace_length])
        key = bytes(check[RECORD_HEADER_BYTES + namespace_length:end])
        return RecordHeader(flags, namespace.decode(), key.decode(), record_sequence,
                            size_bytes, object_version, value_crc)
    except UnicodeDecodeError:
        raise TornHeader() from None
