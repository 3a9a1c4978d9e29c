# Offset allocator for carving a memory segment into aligned ranges.
#
# Owns: OffsetAllocator, which hands out (offset, handle) pairs inside
# [0, capacity_bytes) without touching the memory itself. Design follows
# Sebastian Aaltonen's OffsetAllocator:
#   * sizes (in alignment units) are binned on a small-float scale with a
#     3-bit mantissa, so 64 exponent groups x 8 mantissa bins cover 64-bit sizes;
#   * a two-level bitmap (one 64-bit word of non-empty groups, one 8-bit word
#     of non-empty bins per group) finds the first non-empty bin >= the
#     request's rounded-up bin with two bit scans, i.e. O(1); only if none
#     exists are a bounded few blocks of the request's own bin checked, so an
#     exact fit such as the whole capacity is not refused;
#   * free blocks sit in doubly-linked lists per bin; every block (free or
#     used) is also linked to its address-order neighbours so free() merges
#     with adjacent free blocks in O(1);
#   * nodes live in one fixed C array allocated up front, recycled through a
#     stack of free node indices, so allocate/free never call malloc.
# Handles carry a per-node generation in their high 32 bits so a stale handle
# (double free, or a handle whose node was since reused) is rejected instead
# of freeing someone else's allocation.

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport malloc, free as c_free

cdef extern from *:
    # GCC/Clang bit scans; callers guarantee a non-zero argument.
    int __builtin_ctzll(unsigned long long x) nogil
    int __builtin_clzll(unsigned long long x) nogil

cdef enum:
    _OA_MANTISSA_BITS = 3
    _OA_MANTISSA_VALUE = 8          # 1 << _OA_MANTISSA_BITS
    _OA_MANTISSA_MASK = 7
    _OA_TOP_BINS = 64               # exponent groups; one bit each in _used_top
    _OA_NUM_BINS = 512              # _OA_TOP_BINS * 8 leaf bins
    _OA_OWN_BIN_SCAN = 8            # fallback: blocks checked in the request's own bin

cdef enum _OANodeState:
    _OA_POOLED = 0                  # on the free-node stack, not in the chain
    _OA_FREE = 1                    # a free block: in a bin list and the chain
    _OA_USED = 2                    # a live allocation: in the chain only

cdef uint32_t _OA_NO_NODE = 0xFFFFFFFF
# Node indices are 32-bit and the pool holds 2 * max_allocations + 2 nodes.
cdef uint64_t _OA_MAX_ALLOCATIONS = (1 << 31) - 2

ctypedef struct _OANode:
    uint64_t offset                 # in alignment units
    uint64_t size                   # in alignment units
    uint32_t bin_prev
    uint32_t bin_next
    uint32_t neighbor_prev          # address-order chain
    uint32_t neighbor_next
    uint32_t generation             # bumped each time the node becomes USED
    uint8_t state                   # _OANodeState


cdef inline uint32_t _oa_bin_round_down(uint64_t size) noexcept nogil:
    """Bin whose floor size is the largest one <= size (size >= 1)."""
    cdef int start
    if size < _OA_MANTISSA_VALUE:
        return <uint32_t>size       # denormal range: exact
    start = 63 - __builtin_clzll(size) - _OA_MANTISSA_BITS
    return <uint32_t>(((start + 1) << _OA_MANTISSA_BITS)
                      | ((size >> start) & _OA_MANTISSA_MASK))


cdef inline uint32_t _oa_bin_round_up(uint64_t size) noexcept nogil:
    """Smallest bin whose floor size is >= size (size >= 1).

    Uses + rather than | so a mantissa carry rolls into the next exponent.
    """
    cdef int start
    cdef uint32_t bin_index
    if size < _OA_MANTISSA_VALUE:
        return <uint32_t>size
    start = 63 - __builtin_clzll(size) - _OA_MANTISSA_BITS
    bin_index = (<uint32_t>(start + 1) << _OA_MANTISSA_BITS) + <uint32_t>((size >> start) & _OA_MANTISSA_MASK)
    if size & ((<uint64_t>1 << start) - 1):
        bin_index += 1
    return bin_index


# ---- dump/load encoding ---------------------------------------------------------
#
# OffsetAllocator.dump() writes, after the magic b"MCOA" and a version byte, unsigned LEB128
# varints:
#   header:      shift, capacity_units, max_allocations, allocation_count, free_units,
#                high, chain_len, bin_count
#   generations: `high` values, of nodes 0 .. high-1 (nodes >= high are untouched: pooled,
#                generation 0, and still at their initial place at the bottom of the stack)
#   chain:       `chain_len` blocks in address order, each (index << 1 | used), size_units;
#                offsets and neighbour links follow from the order
#   stack:       the free-node stack above its untouched bottom (high - chain_len indices,
#                bottom to top)
#   bins:        `bin_count` non-empty bins in increasing order, each bin, length, and the
#                node indices from head to tail
# then a CRC-32 (zlib) of everything before it, 4 bytes little-endian. That is every field
# that influences later behaviour; what a pooled node's other fields hold does not, and
# used blocks always have empty bin links. The bitmaps follow from the bin heads.

from zlib import crc32 as _oa_crc32
from cpython.bytes cimport PyBytes_FromStringAndSize

cdef bytes _OA_DUMP_MAGIC = b"MCOA"

cdef enum:
    _OA_DUMP_VERSION = 1
    _OA_MARK_ON_STACK = 3           # load() only: a pooled node already seen on the stack
    _OA_MARK_BINNED = 4             # load() only: a free block already seen in a bin

ctypedef struct _OACursor:
    const uint8_t* data
    Py_ssize_t pos
    Py_ssize_t end


cdef inline Py_ssize_t _oa_put_varint(uint8_t* buf, Py_ssize_t pos, uint64_t value) noexcept nogil:
    while value >= 0x80:
        buf[pos] = <uint8_t>((value & 0x7F) | 0x80)
        value >>= 7
        pos += 1
    buf[pos] = <uint8_t>value
    return pos + 1


cdef int _oa_get(_OACursor* cur, uint64_t* out, uint64_t max_value, str what) except -1:
    """Read one varint <= max_value into out, or raise ValueError naming `what`."""
    cdef uint64_t value = 0
    cdef uint64_t byte
    cdef int shift = 0
    while True:
        if cur.pos >= cur.end:
            raise ValueError(f"allocator dump: truncated at {what}")
        byte = cur.data[cur.pos]
        cur.pos += 1
        if shift == 63 and byte > 1:
            raise ValueError(f"allocator dump: {what} overflows 64 bits")
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            break
        shift += 7
        if shift > 63:
            raise ValueError(f"allocator dump: {what} overflows 64 bits")
    if value > max_value:
        raise ValueError(f"allocator dump: {what} {value} out of range (max {max_value})")
    out[0] = value
    return 0


cdef class OffsetAllocator:
    """Hands out aligned (offset, handle) ranges of [0, capacity_bytes).

    allocate/free are O(1) and do not allocate memory; see the module header
    for the design. Methods never release the GIL, which is the only
    serialisation there is: do not share one across free-threaded threads.
    """

    cdef _OANode* _nodes
    cdef uint32_t* _free_nodes      # stack of POOLED node indices
    cdef uint32_t _free_nodes_len
    cdef uint32_t _node_capacity
    cdef uint64_t _capacity_units
    cdef uint64_t _free_units
    cdef uint64_t _alignment_bytes
    cdef int _shift                 # log2(alignment_bytes)
    cdef uint64_t _allocation_count
    cdef uint64_t _max_allocations
    cdef uint64_t _used_top         # bit g set: group g has a non-empty bin
    cdef uint8_t _used_leaf[_OA_TOP_BINS]
    cdef uint32_t _bin_heads[_OA_NUM_BINS]

    def __cinit__(self, capacity_bytes, alignment_bytes=64, max_allocations=65536):
        cdef uint64_t node_count
        for name, value in (("capacity_bytes", capacity_bytes),
                            ("alignment_bytes", alignment_bytes),
                            ("max_allocations", max_allocations)):
            if not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if alignment_bytes < 1 or alignment_bytes > (1 << 63) or alignment_bytes & (alignment_bytes - 1):
            raise ValueError(f"alignment_bytes must be a power of two >= 1, got {alignment_bytes}")
        if capacity_bytes < alignment_bytes:
            raise ValueError(f"capacity_bytes ({capacity_bytes}) must be >= alignment_bytes ({alignment_bytes})")
        if capacity_bytes >= (1 << 64):
            raise ValueError(f"capacity_bytes must be < 2**64, got {capacity_bytes}")
        if max_allocations < 1 or max_allocations > _OA_MAX_ALLOCATIONS:
            raise ValueError(f"max_allocations must be in [1, {_OA_MAX_ALLOCATIONS}], got {max_allocations}")

        self._alignment_bytes = alignment_bytes
        self._shift = __builtin_ctzll(self._alignment_bytes)
        self._capacity_units = (<uint64_t>capacity_bytes) >> self._shift   # rounds down
        self._max_allocations = max_allocations
        # Live allocations plus at most one free block between/around each.
        node_count = 2 * self._max_allocations + 2
        self._node_capacity = <uint32_t>node_count
        self._nodes = <_OANode*>malloc(node_count * sizeof(_OANode))
        self._free_nodes = <uint32_t*>malloc(node_count * sizeof(uint32_t))
        if self._nodes == NULL or self._free_nodes == NULL:
            raise MemoryError(f"cannot allocate {node_count} allocator nodes")
        cdef uint32_t i
        for i in range(self._node_capacity):
            self._nodes[i].generation = 0
        self._reset()

    def __dealloc__(self):
        c_free(self._nodes)
        c_free(self._free_nodes)

    # ---- internal C helpers -------------------------------------------------

    cdef void _reset(self) noexcept nogil:
        cdef uint32_t i
        cdef uint32_t root
        # Stack top at the end; pop order 0, 1, 2, ... keeps handles small.
        for i in range(self._node_capacity):
            self._free_nodes[i] = self._node_capacity - 1 - i
            self._nodes[i].state = _OA_POOLED   # generations survive a reset
        self._free_nodes_len = self._node_capacity
        for i in range(<uint32_t>_OA_NUM_BINS):
            self._bin_heads[i] = _OA_NO_NODE
        for i in range(<uint32_t>_OA_TOP_BINS):
            self._used_leaf[i] = 0
        self._used_top = 0
        self._free_units = 0
        self._allocation_count = 0
        root = self._insert_free_block(0, self._capacity_units)
        self._nodes[root].neighbor_prev = _OA_NO_NODE
        self._nodes[root].neighbor_next = _OA_NO_NODE

    cdef uint32_t _insert_free_block(self, uint64_t offset, uint64_t size) noexcept nogil:
        """Take a pooled node, make it a free block of `size`, push it on its bin.

        Neighbour links are left for the caller. The pool is sized so that
        a node is always available here (see __cinit__).
        """
        cdef uint32_t bin_index = _oa_bin_round_down(size)
        cdef uint32_t top = bin_index >> _OA_MANTISSA_BITS
        cdef uint32_t leaf = bin_index & _OA_MANTISSA_MASK
        cdef uint32_t head = self._bin_heads[bin_index]
        cdef uint32_t index
        cdef _OANode* node
        if head == _OA_NO_NODE:
            self._used_leaf[top] |= <uint8_t>(1 << leaf)
            self._used_top |= <uint64_t>1 << top
        self._free_nodes_len -= 1
        index = self._free_nodes[self._free_nodes_len]
        node = &self._nodes[index]
        node.offset = offset
        node.size = size
        node.state = _OA_FREE
        node.bin_prev = _OA_NO_NODE
        node.bin_next = head
        if head != _OA_NO_NODE:
            self._nodes[head].bin_prev = index
        self._bin_heads[bin_index] = index
        self._free_units += size
        return index

    cdef void _unlink_from_bin(self, uint32_t index) noexcept nogil:
        """Remove free block `index` from its bin list (state is left to caller)."""
        cdef _OANode* node = &self._nodes[index]
        cdef uint32_t bin_index
        cdef uint32_t top
        if node.bin_prev != _OA_NO_NODE:
            self._nodes[node.bin_prev].bin_next = node.bin_next
        else:
            bin_index = _oa_bin_round_down(node.size)
            self._bin_heads[bin_index] = node.bin_next
            if node.bin_next == _OA_NO_NODE:
                # Bin became empty: clear its leaf bit, and the group bit if
                # that was the group's last non-empty bin.
                top = bin_index >> _OA_MANTISSA_BITS
                self._used_leaf[top] &= <uint8_t>~(1 << (bin_index & _OA_MANTISSA_MASK))
                if self._used_leaf[top] == 0:
                    self._used_top &= ~(<uint64_t>1 << top)
        if node.bin_next != _OA_NO_NODE:
            self._nodes[node.bin_next].bin_prev = node.bin_prev
        node.bin_prev = _OA_NO_NODE
        node.bin_next = _OA_NO_NODE
        self._free_units -= node.size

    cdef inline void _pool_node(self, uint32_t index) noexcept nogil:
        self._nodes[index].state = _OA_POOLED
        self._free_nodes[self._free_nodes_len] = index
        self._free_nodes_len += 1

    cdef uint32_t _find_block(self, uint64_t units) noexcept nogil:
        """Free block index with size >= units, or _OA_NO_NODE."""
        cdef uint32_t min_bin = _oa_bin_round_up(units)
        cdef uint32_t min_top = min_bin >> _OA_MANTISSA_BITS
        cdef uint32_t top = min_top
        cdef uint32_t leaf_bits
        cdef uint64_t top_bits
        cdef uint32_t own_bin
        cdef uint32_t index
        cdef int steps
        # Every block in a bin >= min_bin fits. Same group first: only bins at
        # or above the rounded-up bin's mantissa.
        if self._used_top & (<uint64_t>1 << top):
            leaf_bits = self._used_leaf[top] & (0xFF << (min_bin & _OA_MANTISSA_MASK)) & 0xFF
            if leaf_bits:
                return self._bin_heads[(top << _OA_MANTISSA_BITS) | <uint32_t>__builtin_ctzll(leaf_bits)]
        # Then any higher group: its lowest non-empty bin.
        if min_top + 1 < _OA_TOP_BINS:
            top_bits = self._used_top & (~<uint64_t>0 << (min_top + 1))
            if top_bits:
                top = __builtin_ctzll(top_bits)
                return self._bin_heads[(top << _OA_MANTISSA_BITS)
                                       | <uint32_t>__builtin_ctzll(self._used_leaf[top])]
        # Nothing guaranteed. The request's own (round-down) bin may still hold
        # a big-enough block, e.g. the single full-capacity block after
        # everything is freed; check a bounded few so this stays O(1).
        own_bin = _oa_bin_round_down(units)
        if own_bin == min_bin:
            return _OA_NO_NODE      # already searched above
        index = self._bin_heads[own_bin]
        steps = 0
        while index != _OA_NO_NODE and steps < _OA_OWN_BIN_SCAN:
            if self._nodes[index].size >= units:
                return index
            index = self._nodes[index].bin_next
            steps += 1
        return _OA_NO_NODE

    cdef uint32_t _take_block(self, uint64_t units) noexcept nogil:
        """Allocate `units` (1 <= units <= capacity); node index or _OA_NO_NODE."""
        cdef uint32_t index = self._find_block(units)
        cdef uint32_t remainder
        cdef uint64_t total
        cdef _OANode* node
        if index == _OA_NO_NODE:
            return _OA_NO_NODE
        self._unlink_from_bin(index)
        node = &self._nodes[index]
        total = node.size
        node.size = units
        node.state = _OA_USED
        node.generation += 1
        if total > units:
            # Split: the tail goes back to the bins as a new free block that
            # sits right after this node in address order.
            remainder = self._insert_free_block(node.offset + units, total - units)
            self._nodes[remainder].neighbor_prev = index
            self._nodes[remainder].neighbor_next = node.neighbor_next
            if node.neighbor_next != _OA_NO_NODE:
                self._nodes[node.neighbor_next].neighbor_prev = remainder
            node.neighbor_next = remainder
        self._allocation_count += 1
        return index

    cdef void _release(self, uint32_t index) noexcept nogil:
        """Free live node `index`, merging with free address neighbours."""
        cdef _OANode* node = &self._nodes[index]
        cdef uint64_t offset = node.offset
        cdef uint64_t size = node.size
        cdef uint32_t prev = node.neighbor_prev
        cdef uint32_t next_ = node.neighbor_next
        cdef uint32_t merged
        cdef uint32_t outer
        if prev != _OA_NO_NODE and self._nodes[prev].state == _OA_FREE:
            offset = self._nodes[prev].offset
            size += self._nodes[prev].size
            outer = self._nodes[prev].neighbor_prev
            self._unlink_from_bin(prev)
            self._pool_node(prev)
            prev = outer
        if next_ != _OA_NO_NODE and self._nodes[next_].state == _OA_FREE:
            size += self._nodes[next_].size
            outer = self._nodes[next_].neighbor_next
            self._unlink_from_bin(next_)
            self._pool_node(next_)
            next_ = outer
        self._pool_node(index)
        # The merged block must be re-binned by its new size anyway, so it is
        # simply inserted as a fresh free block (often reusing `index`).
        merged = self._insert_free_block(offset, size)
        self._nodes[merged].neighbor_prev = prev
        self._nodes[merged].neighbor_next = next_
        if prev != _OA_NO_NODE:
            self._nodes[prev].neighbor_next = merged
        if next_ != _OA_NO_NODE:
            self._nodes[next_].neighbor_prev = merged
        self._allocation_count -= 1

    cdef uint32_t _live_index(self, handle) except? 0xFFFFFFFF:
        """Node index of a live allocation's handle, else ValueError."""
        cdef uint64_t value
        cdef uint32_t index
        if not isinstance(handle, int):
            raise TypeError(f"allocation handle must be an int, got {type(handle).__name__}")
        try:
            value = handle
        except OverflowError:
            raise ValueError(f"invalid allocation handle {handle!r}") from None
        index = <uint32_t>(value & 0xFFFFFFFF)
        if (index >= self._node_capacity
                or self._nodes[index].state != _OA_USED
                or self._nodes[index].generation != <uint32_t>(value >> 32)):
            raise ValueError(f"invalid or already freed allocation handle {handle!r}")
        return index

    # ---- public API ---------------------------------------------------------

    def allocate(self, size_bytes):
        """Reserve size_bytes (rounded up to alignment).

        Returns (offset_bytes, handle), or None when no free block is
        guaranteed to fit or max_allocations are live.
        """
        cdef uint64_t size
        cdef uint64_t units
        cdef uint32_t index
        # Reject floats explicitly: Cython's integer conversion would truncate them.
        if not isinstance(size_bytes, int):
            raise TypeError(f"size_bytes must be an int, got {type(size_bytes).__name__}")
        try:
            size = size_bytes
        except OverflowError:
            if size_bytes < 0:
                raise ValueError(f"size_bytes must be > 0, got {size_bytes}") from None
            return None                 # >= 2**64: larger than any capacity
        if size == 0:
            raise ValueError("size_bytes must be > 0, got 0")
        units = size >> self._shift
        if size & (self._alignment_bytes - 1):
            units += 1
        if units > self._capacity_units or self._allocation_count >= self._max_allocations:
            return None
        index = self._take_block(units)
        if index == _OA_NO_NODE:
            return None
        return (self._nodes[index].offset << self._shift,
                (<uint64_t>self._nodes[index].generation << 32) | index)

    def free(self, handle):
        """Free a live allocation; returns the bytes released (rounded size)."""
        cdef uint32_t index = self._live_index(handle)
        cdef uint64_t size = self._nodes[index].size
        self._release(index)
        return size << self._shift

    def allocation_size(self, handle):
        """Rounded size in bytes of a live allocation."""
        cdef uint32_t index = self._live_index(handle)
        return self._nodes[index].size << self._shift

    def reset(self):
        """Free every allocation; all outstanding handles become invalid."""
        self._reset()

    def largest_free_bytes(self):
        """Size in bytes of the largest free block (0 when full)."""
        cdef uint32_t top
        cdef uint32_t bin_index
        cdef uint32_t index
        cdef uint64_t best = 0
        if self._used_top == 0:
            return 0
        # Every block in the highest non-empty bin beats all lower bins, but
        # blocks within that bin differ, so scan its list.
        top = 63 - __builtin_clzll(self._used_top)
        bin_index = (top << _OA_MANTISSA_BITS) | <uint32_t>(63 - __builtin_clzll(self._used_leaf[top]))
        index = self._bin_heads[bin_index]
        while index != _OA_NO_NODE:
            if self._nodes[index].size > best:
                best = self._nodes[index].size
            index = self._nodes[index].bin_next
        return best << self._shift

    def free_extents(self):
        """All free blocks as [(offset_bytes, size_bytes)] in address order.

        O(nodes) debug helper: walks the address-ordered neighbour chain.
        """
        cdef uint32_t index
        cdef uint32_t head = _OA_NO_NODE
        cdef uint32_t steps = 0
        for index in range(self._node_capacity):
            if self._nodes[index].state != _OA_POOLED and self._nodes[index].neighbor_prev == _OA_NO_NODE:
                head = index
                break
        extents = []
        index = head
        while index != _OA_NO_NODE:
            if steps >= self._node_capacity:
                raise RuntimeError("OffsetAllocator neighbour chain is cyclic")
            steps += 1
            if self._nodes[index].state == _OA_FREE:
                extents.append((self._nodes[index].offset << self._shift,
                                self._nodes[index].size << self._shift))
            index = self._nodes[index].neighbor_next
        return extents

    def bin_size_for(self, size_bytes):
        """Smallest free-block size (bytes) guaranteed to satisfy size_bytes.

        That is the floor size of the request's rounded-up bin; a free block
        at least this large is always found by allocate().
        """
        cdef uint64_t units
        cdef uint32_t bin_index
        if not isinstance(size_bytes, int):
            raise TypeError(f"size_bytes must be an int, got {type(size_bytes).__name__}")
        if size_bytes <= 0:
            raise ValueError(f"size_bytes must be > 0, got {size_bytes}")
        whole_units = -(-size_bytes // self._alignment_bytes)
        if whole_units >= (1 << 64):
            raise ValueError(f"size_bytes too large: {size_bytes}")
        units = whole_units
        bin_index = _oa_bin_round_up(units)
        exponent = bin_index >> _OA_MANTISSA_BITS
        mantissa = bin_index & _OA_MANTISSA_MASK
        # Python ints: the top rounded-up bin's size is 2**64 units.
        if exponent == 0:
            bin_units = mantissa
        else:
            bin_units = (mantissa | _OA_MANTISSA_VALUE) << (exponent - 1)
        return bin_units * self._alignment_bytes

    @property
    def capacity_bytes(self):
        return self._capacity_units << self._shift

    @property
    def alignment_bytes(self):
        return self._alignment_bytes

    @property
    def used_bytes(self):
        return (self._capacity_units - self._free_units) << self._shift

    @property
    def free_bytes(self):
        return self._free_units << self._shift

    @property
    def allocation_count(self):
        return self._allocation_count

    @property
    def max_allocations(self):
        return self._max_allocations

    def allocation_offset(self, handle):
        """Offset in bytes of a live allocation."""
        cdef uint32_t index = self._live_index(handle)
        return self._nodes[index].offset << self._shift

    # ---- snapshots ------------------------------------------------------------

    def dump(self):
        """The allocator's complete state as bytes (see the encoding above the class).

        OffsetAllocator.load(dump) gives an allocator that behaves identically from then on:
        the same offsets and handles for the same calls. Equal dumps mean equal states, so
        the bytes also serve as a digest. Size: a few bytes per block and per touched node.
        """
        cdef uint32_t cap = self._node_capacity
        cdef uint32_t stack_len = self._free_nodes_len
        cdef uint32_t chain_len = cap - stack_len
        cdef uint32_t prefix = 0
        cdef uint32_t high
        cdef uint32_t i
        cdef uint32_t index
        cdef uint32_t head = _OA_NO_NODE
        cdef uint32_t length
        cdef uint32_t bin_count = 0
        cdef Py_ssize_t bound
        cdef Py_ssize_t pos
        cdef uint8_t* buf
        # The untouched bottom of the stack: still cap-1, cap-2, ... with generation 0.
        while (prefix < stack_len and self._free_nodes[prefix] == cap - 1 - prefix
               and self._nodes[cap - 1 - prefix].generation == 0):
            prefix += 1
        high = cap - prefix
        for i in range(<uint32_t>_OA_NUM_BINS):
            if self._bin_heads[i] != _OA_NO_NODE:
                bin_count += 1
        for i in range(high):
            if self._nodes[i].state != _OA_POOLED and self._nodes[i].neighbor_prev == _OA_NO_NODE:
                head = i
                break
        # Varints of u32 take <= 5 bytes, of u64 <= 10.
        bound = (5 + 8 * 10 + 5 * <Py_ssize_t>high + 15 * <Py_ssize_t>chain_len
                 + 5 * <Py_ssize_t>(stack_len - prefix) + 10 * <Py_ssize_t>bin_count
                 + 5 * <Py_ssize_t>chain_len)
        buf = <uint8_t*>malloc(bound)
        if buf == NULL:
            raise MemoryError("cannot allocate the allocator dump buffer")
        try:
            buf[0] = b'M'
            buf[1] = b'C'
            buf[2] = b'O'
            buf[3] = b'A'
            buf[4] = _OA_DUMP_VERSION
            pos = 5
            pos = _oa_put_varint(buf, pos, <uint64_t>self._shift)
            pos = _oa_put_varint(buf, pos, self._capacity_units)
            pos = _oa_put_varint(buf, pos, self._max_allocations)
            pos = _oa_put_varint(buf, pos, self._allocation_count)
            pos = _oa_put_varint(buf, pos, self._free_units)
            pos = _oa_put_varint(buf, pos, high)
            pos = _oa_put_varint(buf, pos, chain_len)
            pos = _oa_put_varint(buf, pos, bin_count)
            for i in range(high):
                pos = _oa_put_varint(buf, pos, self._nodes[i].generation)
            index = head
            for i in range(chain_len):
                if index == _OA_NO_NODE:
                    raise RuntimeError("OffsetAllocator neighbour chain is broken")
                pos = _oa_put_varint(buf, pos, (<uint64_t>index << 1)
                                     | (1 if self._nodes[index].state == _OA_USED else 0))
                pos = _oa_put_varint(buf, pos, self._nodes[index].size)
                index = self._nodes[index].neighbor_next
            if index != _OA_NO_NODE:
                raise RuntimeError("OffsetAllocator neighbour chain is broken")
            for i in range(prefix, stack_len):
                pos = _oa_put_varint(buf, pos, self._free_nodes[i])
            for i in range(<uint32_t>_OA_NUM_BINS):
                if self._bin_heads[i] == _OA_NO_NODE:
                    continue
                length = 0
                index = self._bin_heads[i]
                while index != _OA_NO_NODE:
                    length += 1
                    index = self._nodes[index].bin_next
                pos = _oa_put_varint(buf, pos, i)
                pos = _oa_put_varint(buf, pos, length)
                index = self._bin_heads[i]
                while index != _OA_NO_NODE:
                    pos = _oa_put_varint(buf, pos, index)
                    index = self._nodes[index].bin_next
            body = PyBytes_FromStringAndSize(<char*>buf, pos)
        finally:
            c_free(buf)
        return body + (_oa_crc32(body) & 0xFFFFFFFF).to_bytes(4, "little")

    @staticmethod
    def load(data):
        """An allocator in exactly the state `data` (from dump()) describes.

        Checks everything: magic, version, checksum, every field's range, and that the blocks
        tile the capacity, bins hold exactly the free blocks by size, and the stack holds
        exactly the pooled nodes. Raises ValueError for any bad input.
        """
        cdef bytes raw
        cdef const uint8_t* p
        cdef _OACursor cur
        cdef uint64_t shift, capacity_units, max_allocations, allocation_count, free_units
        cdef uint64_t high, chain_len, bin_count, value, size, bin_index, length
        cdef uint64_t offset = 0
        cdef uint64_t used_count = 0
        cdef uint64_t free_count = 0
        cdef uint64_t free_sum = 0
        cdef uint64_t binned = 0
        cdef uint64_t k, j
        cdef int64_t last_bin = -1
        cdef uint32_t cap, i, index, prev, stack_pos, top
        cdef bint prev_free = False
        cdef OffsetAllocator alloc
        cdef _OANode* node
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"allocator dump must be bytes, got {type(data).__name__}")
        raw = bytes(data)
        if len(raw) < 9:
            raise ValueError(f"allocator dump: too short ({len(raw)} bytes)")
        if raw[:4] != _OA_DUMP_MAGIC:
            raise ValueError("allocator dump: bad magic")
        if raw[4] != _OA_DUMP_VERSION:
            raise ValueError(f"allocator dump: unsupported version {raw[4]}")
        if (_oa_crc32(raw[:len(raw) - 4]) & 0xFFFFFFFF) != int.from_bytes(raw[len(raw) - 4:], "little"):
            raise ValueError("allocator dump: checksum mismatch")
        p = <const uint8_t*><const char*>raw
        cur.data = p
        cur.pos = 5
        cur.end = len(raw) - 4

        _oa_get(&cur, &shift, 63, "alignment shift")
        _oa_get(&cur, &capacity_units, (~<uint64_t>0) >> shift, "capacity")
        if capacity_units == 0:
            raise ValueError("allocator dump: capacity 0")
        _oa_get(&cur, &max_allocations, _OA_MAX_ALLOCATIONS, "max_allocations")
        if max_allocations == 0:
            raise ValueError("allocator dump: max_allocations 0")
        _oa_get(&cur, &allocation_count, max_allocations, "allocation count")
        _oa_get(&cur, &free_units, capacity_units, "free units")
        _oa_get(&cur, &high, 2 * max_allocations + 2, "node high-water mark")
        _oa_get(&cur, &chain_len, high, "block count")
        if chain_len == 0:
            raise ValueError("allocator dump: no blocks")
        _oa_get(&cur, &bin_count, _OA_NUM_BINS, "bin count")
        # Every varint takes at least one byte: refuse before allocating anything big.
        if <uint64_t>(cur.end - cur.pos) < high + chain_len + high:
            raise ValueError("allocator dump: truncated")

        alloc = OffsetAllocator((<object>capacity_units) << shift, (<object>1) << shift,
                                max_allocations)
        cap = alloc._node_capacity
        for i in range(cap):
            node = &alloc._nodes[i]
            node.offset = 0
            node.size = 0
            node.bin_prev = _OA_NO_NODE
            node.bin_next = _OA_NO_NODE
            node.neighbor_prev = _OA_NO_NODE
            node.neighbor_next = _OA_NO_NODE
            node.generation = 0
            node.state = _OA_POOLED
        for i in range(<uint32_t>_OA_NUM_BINS):
            alloc._bin_heads[i] = _OA_NO_NODE
        for i in range(<uint32_t>_OA_TOP_BINS):
            alloc._used_leaf[i] = 0
        alloc._used_top = 0

        for i in range(<uint32_t>high):
            _oa_get(&cur, &value, 0xFFFFFFFF, "generation")
            alloc._nodes[i].generation = <uint32_t>value

        # Blocks in address order: they must tile [0, capacity) with no two free ones adjacent.
        prev = _OA_NO_NODE
        for k in range(chain_len):
            _oa_get(&cur, &value, 2 * high - 1, "block node")
            index = <uint32_t>(value >> 1)
            node = &alloc._nodes[index]
            if node.state != _OA_POOLED:
                raise ValueError(f"allocator dump: node {index} appears twice in the chain")
            _oa_get(&cur, &size, capacity_units - offset, "block size")
            if size == 0:
                raise ValueError("allocator dump: empty block")
            if value & 1:
                node.state = _OA_USED
                used_count += 1
                prev_free = False
            else:
                if prev_free:
                    raise ValueError("allocator dump: two adjacent free blocks")
                node.state = _OA_FREE
                free_count += 1
                free_sum += size
                prev_free = True
            node.offset = offset
            node.size = size
            node.neighbor_prev = prev
            if prev != _OA_NO_NODE:
                alloc._nodes[prev].neighbor_next = index
            prev = index
            offset += size
        if offset != capacity_units:
            raise ValueError("allocator dump: blocks do not cover the capacity")
        if used_count != allocation_count or free_sum != free_units:
            raise ValueError("allocator dump: counters disagree with the blocks")

        # The stack: its untouched bottom, then exactly the other pooled nodes, once each.
        stack_pos = cap - <uint32_t>high
        for i in range(stack_pos):
            alloc._free_nodes[i] = cap - 1 - i
        for k in range(high - chain_len):
            _oa_get(&cur, &value, high - 1, "pooled node")
            node = &alloc._nodes[value]
            if node.state != _OA_POOLED:
                raise ValueError(f"allocator dump: stack entry {value} is not a pooled node")
            node.state = _OA_MARK_ON_STACK
            alloc._free_nodes[stack_pos] = <uint32_t>value
            stack_pos += 1
        alloc._free_nodes_len = stack_pos
        for i in range(cap - <uint32_t>high, stack_pos):
            alloc._nodes[alloc._free_nodes[i]].state = _OA_POOLED

        # Bins: each free block exactly once, in the bin its size rounds down to.
        for k in range(bin_count):
            _oa_get(&cur, &bin_index, _OA_NUM_BINS - 1, "bin")
            if <int64_t>bin_index <= last_bin:
                raise ValueError("allocator dump: bins out of order")
            last_bin = <int64_t>bin_index
            _oa_get(&cur, &length, free_count - binned, "bin length")
            if length == 0:
                raise ValueError("allocator dump: empty bin listed")
            prev = _OA_NO_NODE
            for j in range(length):
                _oa_get(&cur, &value, high - 1, "bin entry")
                index = <uint32_t>value
                node = &alloc._nodes[index]
                if node.state != _OA_FREE:
                    raise ValueError(f"allocator dump: bin entry {index} is not a free block "
                                     "or is listed twice")
                if _oa_bin_round_down(node.size) != bin_index:
                    raise ValueError(f"allocator dump: block {index} is in the wrong bin")
                node.state = _OA_MARK_BINNED
                node.bin_prev = prev
                if prev == _OA_NO_NODE:
                    alloc._bin_heads[bin_index] = index
                else:
                    alloc._nodes[prev].bin_next = index
                prev = index
            binned += length
            top = <uint32_t>(bin_index >> _OA_MANTISSA_BITS)
            alloc._used_leaf[top] |= <uint8_t>(1 << (bin_index & _OA_MANTISSA_MASK))
            alloc._used_top |= <uint64_t>1 << top
        if binned != free_count:
            raise ValueError("allocator dump: a free block is in no bin")
        if cur.pos != cur.end:
            raise ValueError("allocator dump: trailing bytes")
        for i in range(<uint32_t>high):
            if alloc._nodes[i].state == _OA_MARK_BINNED:
                alloc._nodes[i].state = _OA_FREE
        alloc._free_units = free_sum
        alloc._allocation_count = used_count
        return alloc
