# POSIX and Linux declarations the event loop needs that Cython's bundled .pxd files lack:
# sendmsg/msghdr, eventfd, poll bits, a few errno values and clock_gettime's clock.


from posix.uio cimport iovec


cdef extern from "<sys/socket.h>" nogil:
    ctypedef unsigned int socklen_t

    struct sockaddr:
        unsigned short sa_family

    struct msghdr:
        void *msg_name
        socklen_t msg_namelen
        iovec *msg_iov
        size_t msg_iovlen
        void *msg_control
        size_t msg_controllen
        int msg_flags

    enum:
        MSG_NOSIGNAL
        MSG_DONTWAIT
        SHUT_WR

    ssize_t sendmsg(int sockfd, const msghdr *msg, int flags)
    int shutdown(int sockfd, int how)


cdef extern from "<sys/eventfd.h>" nogil:
    enum:
        EFD_NONBLOCK
        EFD_CLOEXEC
    int eventfd(unsigned int initval, int flags)


cdef extern from "<poll.h>" nogil:
    enum:
        POLLIN
        POLLOUT
        POLLERR
        POLLHUP


cdef extern from "<errno.h>" nogil:
    int errno
    enum:
        EINTR
        ENOSYS
        EPERM
        EBUSY
        EWOULDBLOCK
        EAGAIN
        ECANCELED
        ETIME
        ENOENT
        EALREADY
        EINVAL
        EEXIST
        EMFILE
        ENFILE
        ENOBUFS
        ENOMEM
        ECONNABORTED


cdef extern from "<sys/uio.h>" nogil:
    enum:
        IOV_MAX
