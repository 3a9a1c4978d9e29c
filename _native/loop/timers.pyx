# The timer heap: a binary min-heap of TimerHandle in a Python list.
#
# Owns: the ordering (deadline, then call order: two timers due at the same moment run in
# the order call_at was called, which heapq over asyncio.TimerHandle does not promise) and
# push / pop / heapify. Cancelled timers stay in the heap until they reach the top or the
# loop rebuilds it (loop.pyx decides when, as asyncio does).

from libc.math cimport ceil
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC


cdef inline double _monotonic() noexcept:
    """time.monotonic(): the same clock, so asyncio code mixing both stays consistent."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <double>ts.tv_sec + <double>ts.tv_nsec * 1e-9


cdef inline bint _timer_before(TimerHandle a, TimerHandle b) noexcept:
    return a._when < b._when or (a._when == b._when and a._seq < b._seq)


cdef void _heap_sift_down(list heap, Py_ssize_t start, Py_ssize_t pos):
    """Move heap[pos] up towards start until its parent is earlier (heapq's _siftdown)."""
    cdef TimerHandle item = heap[pos]
    cdef TimerHandle parent
    cdef Py_ssize_t parent_pos
    while pos > start:
        parent_pos = (pos - 1) >> 1
        parent = heap[parent_pos]
        if _timer_before(item, parent):
            heap[pos] = parent
            pos = parent_pos
            continue
        break
    heap[pos] = item


cdef void _heap_sift_up(list heap, Py_ssize_t pos):
    """Move heap[pos] down to a leaf, then back up to its place (heapq's _siftup)."""
    cdef Py_ssize_t end = len(heap)
    cdef Py_ssize_t start = pos
    cdef Py_ssize_t child = 2 * pos + 1
    cdef Py_ssize_t right
    cdef TimerHandle item = heap[pos]
    while child < end:
        right = child + 1
        if right < end and not _timer_before(<TimerHandle>heap[child], <TimerHandle>heap[right]):
            child = right
        heap[pos] = heap[child]
        pos = child
        child = 2 * pos + 1
    heap[pos] = item
    _heap_sift_down(heap, start, pos)


cdef void _heap_push(list heap, TimerHandle timer):
    heap.append(timer)
    _heap_sift_down(heap, 0, len(heap) - 1)


cdef TimerHandle _heap_pop(list heap):
    cdef TimerHandle last = heap.pop()
    cdef TimerHandle first
    if not heap:
        return last
    first = heap[0]
    heap[0] = last
    _heap_sift_up(heap, 0)
    return first


cdef void _heapify(list heap):
    cdef Py_ssize_t i
    for i in reversed(range(len(heap) // 2)):
        _heap_sift_up(heap, i)


cdef inline int64_t _timeout_ns(double delay) noexcept:
    """A wait for `delay` seconds, rounded up so the wait never ends before the deadline."""
    if delay <= 0:
        return 0
    if delay > 86400.0:
        return 86400 * 1000000000  # a day; the loop simply waits again
    return <int64_t>ceil(delay * 1e9)
