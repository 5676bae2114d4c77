# The compiled ring's fields and C methods (_shm_ring.pyx), for the compiled readers that cimport it.
from libc.stdint cimport uint32_t, uint64_t


cdef class Ring:
    cdef readonly object seg
    cdef readonly object data
    cdef readonly object words
    cdef readonly Py_ssize_t cap
    cdef readonly Py_ssize_t mask
    cdef public unsigned long long head
    cdef public unsigned long long tail
    cdef unsigned char[::1] _data
    cdef unsigned long long[::1] _words
    cdef unsigned char *_base
    cdef unsigned long long *_w

    cdef bint _write(self, const unsigned char *hdr, Py_ssize_t hlen,
                     const unsigned char *pay, Py_ssize_t plen) except -1
    cdef bint _next(self, Py_ssize_t *start, uint32_t *hlen_out, uint64_t *plen_out, uint32_t *rlen_out) except -1
    cdef void _advance(self, unsigned long long rlen) noexcept
