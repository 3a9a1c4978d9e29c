# The part of liburing 2.3 (Debian bookworm's liburing-dev) that the event loop uses.
#
# Declarations only, all nogil; field lists name just the members _native/loop/ touches.
# The kernel (6.x) knows more than these 2.3 headers; nothing here needs a newer header.

from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t

from includes.system cimport msghdr, sockaddr, socklen_t


cdef extern from "liburing.h" nogil:
    struct __kernel_timespec:
        int64_t tv_sec
        long long tv_nsec

    struct io_uring_sqe:
        uint8_t opcode
        uint8_t flags
        uint16_t ioprio        # recv/send: IORING_RECVSEND_*; accept: IORING_ACCEPT_*
        int32_t fd
        uint32_t msg_flags
        uint64_t user_data

    struct io_uring_cqe:
        uint64_t user_data
        int32_t res
        uint32_t flags

    struct io_uring_sq:
        unsigned ring_entries

    struct io_uring_cq:
        unsigned ring_entries

    struct io_uring:
        io_uring_sq sq
        io_uring_cq cq
        unsigned flags
        int ring_fd
        unsigned features

    struct io_uring_params:
        uint32_t sq_entries
        uint32_t cq_entries
        uint32_t flags
        uint32_t features

    struct io_uring_probe:
        uint8_t last_op

    # setup flags
    enum:
        IORING_SETUP_CQSIZE
        IORING_SETUP_R_DISABLED
        IORING_SETUP_SUBMIT_ALL
        IORING_SETUP_COOP_TASKRUN
        IORING_SETUP_TASKRUN_FLAG
        IORING_SETUP_SINGLE_ISSUER
        IORING_SETUP_DEFER_TASKRUN
    # features
    enum:
        IORING_FEAT_NODROP
        IORING_FEAT_EXT_ARG
    # sqe flags, per-op flags
    enum:
        IOSQE_ASYNC
        IORING_RECVSEND_POLL_FIRST
        IORING_POLL_ADD_MULTI
        IORING_ASYNC_CANCEL_ALL
        IORING_ASYNC_CANCEL_ANY
        IORING_ACCEPT_MULTISHOT
    # cqe flags
    enum:
        IORING_CQE_F_MORE
        IORING_CQE_F_NOTIF
    enum:
        IORING_REGISTER_ENABLE_RINGS
    # opcodes, for the probe
    enum:
        IORING_OP_NOP
        IORING_OP_POLL_ADD
        IORING_OP_POLL_REMOVE
        IORING_OP_SENDMSG
        IORING_OP_ACCEPT
        IORING_OP_ASYNC_CANCEL
        IORING_OP_READ
        IORING_OP_SEND
        IORING_OP_RECV
        IORING_OP_SEND_ZC

    int io_uring_queue_init_params(unsigned entries, io_uring *ring, io_uring_params *p)
    void io_uring_queue_exit(io_uring *ring)
    # 2.3 declares io_uring_enable_rings() but its .so does not export it: use the raw
    # register call with IORING_REGISTER_ENABLE_RINGS instead.
    int io_uring_register(unsigned int fd, unsigned int opcode, const void *arg,
                          unsigned int nr_args)
    io_uring_probe *io_uring_get_probe_ring(io_uring *ring)
    int io_uring_opcode_supported(const io_uring_probe *p, int op)
    void io_uring_free_probe(io_uring_probe *probe)

    io_uring_sqe *io_uring_get_sqe(io_uring *ring)
    unsigned io_uring_sq_ready(const io_uring *ring)
    int io_uring_submit(io_uring *ring)
    int io_uring_submit_and_get_events(io_uring *ring)
    int io_uring_get_events(io_uring *ring)
    int io_uring_submit_and_wait_timeout(io_uring *ring, io_uring_cqe **cqe_ptr,
                                         unsigned wait_nr, __kernel_timespec *ts,
                                         void *sigmask)
    unsigned io_uring_peek_batch_cqe(io_uring *ring, io_uring_cqe **cqes, unsigned count)
    void io_uring_cq_advance(io_uring *ring, unsigned nr)
    unsigned io_uring_cq_ready(const io_uring *ring)

    void io_uring_sqe_set_data64(io_uring_sqe *sqe, uint64_t data)
    void io_uring_sqe_set_flags(io_uring_sqe *sqe, unsigned flags)

    void io_uring_prep_nop(io_uring_sqe *sqe)
    void io_uring_prep_recv(io_uring_sqe *sqe, int sockfd, void *buf, size_t len, int flags)
    void io_uring_prep_send(io_uring_sqe *sqe, int sockfd, const void *buf, size_t len,
                            int flags)
    void io_uring_prep_send_zc(io_uring_sqe *sqe, int sockfd, const void *buf, size_t len,
                               int flags, unsigned zc_flags)
    void io_uring_prep_sendmsg(io_uring_sqe *sqe, int fd, const msghdr *msg, unsigned flags)
    void io_uring_prep_read(io_uring_sqe *sqe, int fd, void *buf, unsigned nbytes,
                            uint64_t offset)
    void io_uring_prep_accept(io_uring_sqe *sqe, int fd, sockaddr *addr, socklen_t *addrlen,
                              int flags)
    void io_uring_prep_multishot_accept(io_uring_sqe *sqe, int fd, sockaddr *addr,
                                        socklen_t *addrlen, int flags)
    void io_uring_prep_poll_add(io_uring_sqe *sqe, int fd, unsigned poll_mask)
    void io_uring_prep_poll_remove(io_uring_sqe *sqe, uint64_t user_data)
    void io_uring_prep_cancel64(io_uring_sqe *sqe, uint64_t user_data, int flags)

    # The disk ring (_native/disk/disk_ring.pyx): file reads, writes and datasyncs, with
    # completions announced on an eventfd.
    enum:
        IORING_FSYNC_DATASYNC
    int io_uring_queue_init(unsigned entries, io_uring *ring, unsigned flags)
    int io_uring_register_eventfd(io_uring *ring, int fd)
    void io_uring_prep_write(io_uring_sqe *sqe, int fd, const void *buf, unsigned nbytes,
                             uint64_t offset)
    void io_uring_prep_fsync(io_uring_sqe *sqe, int fd, unsigned fsync_flags)
