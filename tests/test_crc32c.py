"""CRC32C of mooncaked._native: the standard vectors (RFC 3720 B.4 and the usual "123456789"),
the hardware and table versions agreeing, and continuation over parts."""

import os

import pytest

from mooncaked._native import buffer_address, crc32c, crc32c_address, crc32c_implementation
from mooncaked._native import crc32c_table

# RFC 3720 (iSCSI) appendix B.4, and the check value of the CRC catalogue.
VECTORS = [
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
    (b"", 0),
]


@pytest.mark.parametrize("data,expected", VECTORS, ids=[f"v{i}" for i in range(len(VECTORS))])
def test_standard_vectors(data, expected):
    assert crc32c(data) == expected
    assert crc32c_table(data) == expected


def test_implementation_is_named():
    assert crc32c_implementation() in ("sse4.2", "table")


def test_hardware_and_table_agree_at_every_length_and_alignment():
    data = os.urandom(4096 + 64)
    view = memoryview(data)
    for start in range(9):
        for length in list(range(0, 80)) + [1000, 4095, 4096]:
            part = view[start:start + length]
            assert crc32c(part) == crc32c_table(part), (start, length)


def test_continuation_over_parts_equals_the_whole():
    data = os.urandom(300_000)  # past the size where the GIL is released
    whole = crc32c(data)
    assert crc32c(data[200_000:], crc32c(data[:200_000])) == whole
    assert crc32c_table(data[77:], crc32c_table(data[:77])) == whole


def test_address_form_and_buffer_kinds():
    data = bytearray(os.urandom(10_000))
    assert crc32c_address(buffer_address(data), len(data)) == crc32c(data)
    assert crc32c(memoryview(data)[10:20]) == crc32c(bytes(data[10:20]))
    with pytest.raises(ValueError):
        crc32c_address(0, 10)
