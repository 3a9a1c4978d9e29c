# CRC32C (Castagnoli, the iSCSI/ext4 checksum) of the disk tier's records.
#
# Owns: crc32c() over any contiguous buffer, crc32c_address() over raw memory, and
# crc32c_table() (the portable table version, for tests that compare the two). The SSE4.2
# crc32 instruction is used when the CPU has it (checked once, at import); otherwise a
# slicing-by-8 table. Large inputs are checksummed with the GIL released.

from libc.stdint cimport uint8_t, uint32_t
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>

    static uint32_t mc_crc32c_tables[8][256];

    static void mc_crc32c_init_tables(void) {
        for (uint32_t n = 0; n < 256; n++) {
            uint32_t c = n;
            for (int k = 0; k < 8; k++)
                c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
            mc_crc32c_tables[0][n] = c;
        }
        for (uint32_t n = 0; n < 256; n++) {
            uint32_t c = mc_crc32c_tables[0][n];
            for (int t = 1; t < 8; t++) {
                c = mc_crc32c_tables[0][c & 0xff] ^ (c >> 8);
                mc_crc32c_tables[t][n] = c;
            }
        }
    }

    /* crc is the running value (0 to start); the result is finished (xored) as usual. */
    static uint32_t mc_crc32c_table(uint32_t crc, const uint8_t *p, size_t n) {
        crc = ~crc;
        while (n && ((uintptr_t)p & 7)) {
            crc = mc_crc32c_tables[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
            n--;
        }
        while (n >= 8) {
            uint64_t word;
            memcpy(&word, p, 8);
            word ^= crc;
            crc = mc_crc32c_tables[7][word & 0xff] ^
                  mc_crc32c_tables[6][(word >> 8) & 0xff] ^
                  mc_crc32c_tables[5][(word >> 16) & 0xff] ^
                  mc_crc32c_tables[4][(word >> 24) & 0xff] ^
                  mc_crc32c_tables[3][(word >> 32) & 0xff] ^
                  mc_crc32c_tables[2][(word >> 40) & 0xff] ^
                  mc_crc32c_tables[1][(word >> 48) & 0xff] ^
                  mc_crc32c_tables[0][word >> 56];
            p += 8;
            n -= 8;
        }
        while (n--)
            crc = mc_crc32c_tables[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
        return ~crc;
    }

    #if defined(__x86_64__)
    __attribute__((target("sse4.2")))
    static uint32_t mc_crc32c_sse42(uint32_t crc, const uint8_t *p, size_t n) {
        uint64_t c = ~crc;
        while (n && ((uintptr_t)p & 7)) {
            c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
            n--;
        }
        while (n >= 8) {
            uint64_t word;
            memcpy(&word, p, 8);
            c = __builtin_ia32_crc32di(c, word);
            p += 8;
            n -= 8;
        }
        while (n--)
            c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
        return ~(uint32_t)c;
    }
    static int mc_crc32c_has_sse42(void) {
        __builtin_cpu_init();
        return __builtin_cpu_supports("sse4.2");
    }
    #else
    static uint32_t mc_crc32c_sse42(uint32_t crc, const uint8_t *p, size_t n) {
        return mc_crc32c_table(crc, p, n);
    }
    static int mc_crc32c_has_sse42(void) { return 0; }
    #endif
    """
    void mc_crc32c_init_tables() nogil
    uint32_t mc_crc32c_table(uint32_t crc, const uint8_t *p, size_t n) nogil
    uint32_t mc_crc32c_sse42(uint32_t crc, const uint8_t *p, size_t n) nogil
    int mc_crc32c_has_sse42() nogil


cdef enum:
    CRC_NOGIL_BYTES = 65536   # below this, releasing the GIL costs more than it frees

mc_crc32c_init_tables()
cdef bint _crc32c_hardware = mc_crc32c_has_sse42() != 0


cdef inline uint32_t _crc32c(uint32_t crc, const uint8_t *p, size_t n) noexcept nogil:
    if _crc32c_hardware:
        return mc_crc32c_sse42(crc, p, n)
    return mc_crc32c_table(crc, p, n)


def crc32c(data, uint32_t crc=0):
    """CRC32C of a contiguous buffer (bytes, memoryview, mmap, ...); `crc` continues a
    checksum over an earlier part (pass the earlier result)."""
    cdef Py_buffer view
    cdef uint32_t result
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        if view.len >= CRC_NOGIL_BYTES:
            with nogil:
                result = _crc32c(crc, <const uint8_t *>view.buf, view.len)
        else:
            result = _crc32c(crc, <const uint8_t *>view.buf, view.len)
    finally:
        PyBuffer_Release(&view)
    return result


def crc32c_address(size_t address, size_t size_bytes, uint32_t crc=0):
    """CRC32C of size_bytes of raw memory at address; the caller keeps it valid."""
    cdef uint32_t result
    if size_bytes and address == 0:
        raise ValueError("crc32c_address: null address")
    with nogil:
        result = _crc32c(crc, <const uint8_t *>address, size_bytes)
    return result


def crc32c_table(data, uint32_t crc=0):
    """CRC32C by the table alone, whatever the CPU has (to check the two agree)."""
    cdef Py_buffer view
    cdef uint32_t result
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        result = mc_crc32c_table(crc, <const uint8_t *>view.buf, view.len)
    finally:
        PyBuffer_Release(&view)
    return result


def crc32c_implementation():
    """"sse4.2" when the crc32 instruction is used, "table" otherwise."""
    return "sse4.2" if _crc32c_hardware else "table"
