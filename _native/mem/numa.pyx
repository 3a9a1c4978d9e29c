# NUMA placement of segment memory, bound directly to libnuma (Debian libnuma-dev).
#
# Owns: numa_usable(), numa_node_count(), numa_node_memory(), bind_to_node() and
# nodes_of_pages(). Node numbers are checked against the machine before libnuma sees
# them: libnuma's own handling of a bad node is a printed warning, not an error.

cdef extern from "numa.h" nogil:
    int numa_available()
    int numa_max_node()
    long long numa_node_size64(int node, long long *freep)
    void numa_tonode_memory(void *start, size_t size, int node)

cdef extern from "numaif.h" nogil:
    long move_pages(int pid, unsigned long count, void **pages, const int *nodes,
                    int *status, int flags)

from libc.stdlib cimport malloc, free
from libc.errno cimport errno


def numa_usable():
    """True when the kernel supports NUMA policy (even on a one-node machine)."""
    return numa_available() >= 0


def numa_node_count():
    """Number of NUMA nodes (1 on a machine without NUMA support)."""
    if numa_available() < 0:
        return 1
    return numa_max_node() + 1


def _check_node(int node):
    if numa_available() < 0:
        raise ValueError("this kernel has no NUMA support")
    if node < 0 or node > numa_max_node():
        raise ValueError(f"NUMA node {node} does not exist (nodes 0..{numa_max_node()})")


def numa_node_memory(int node):
    """(total_bytes, free_bytes) of a NUMA node."""
    cdef long long free_bytes = 0
    _check_node(node)
    total = numa_node_size64(node, &free_bytes)
    return total, free_bytes


def bind_to_node(size_t address, size_t size_bytes, int node):
    """Set the memory policy of a mapped range so its pages are allocated on `node`.

    Pages already present are not moved; bind before the first touch (or prefault after).
    """
    _check_node(node)
    if address == 0 or size_bytes == 0:
        raise ValueError("bind_to_node: empty range")
    with nogil:
        numa_tonode_memory(<void*>address, size_bytes, node)


def nodes_of_pages(size_t address, size_t size_bytes, size_t page_bytes=4096, size_t stride=1):
    """{node: present pages} for a range, asked of the kernel; for checks and tests.

    Samples every `stride`-th page. Pages not present yet are left out.
    """
    cdef unsigned long count = (size_bytes + page_bytes - 1) // page_bytes // stride
    cdef unsigned long i
    cdef void **pages
    cdef int *status
    cdef long rc
    if count == 0:
        return {}
    pages = <void**>malloc(count * sizeof(void*))
    status = <int*>malloc(count * sizeof(int))
    if pages == NULL or status == NULL:
        free(pages)
        free(status)
        raise MemoryError()
    try:
        for i in range(count):
            pages[i] = <void*>(address + i * stride * page_bytes)
        with nogil:
            rc = move_pages(0, count, pages, NULL, status, 0)
        if rc < 0:
            raise OSError(errno, "move_pages failed")
        counts = {}
        for i in range(count):
            if status[i] >= 0:
                counts[status[i]] = counts.get(status[i], 0) + 1
        return counts
    finally:
        free(pages)
        free(status)
