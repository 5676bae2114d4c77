# The compiled matcher's fields and C methods (_matching.pyx), for the compiled readers that cimport it.


cdef bint same_fp(sent, want) except -1


cdef class PendingRecv:
    cdef readonly object src
    cdef readonly tuple key
    cdef readonly object buf
    cdef readonly object fp
    cdef readonly long long order
    cdef readonly object future
    cdef Py_ssize_t nbytes


cdef class _Held:
    cdef readonly object fp
    cdef readonly object payload
    cdef readonly long long order
    cdef Py_ssize_t nbytes


cdef class Mailbox:
    cdef public object rank
    cdef public object loop
    cdef public object unexpected_cap
    cdef public object unexpected_bytes
    cdef public object on_mismatch
    cdef public object on_drain
    cdef public object on_post
    cdef public object on_late
    cdef public dict origin_books
    cdef dict _posted
    cdef dict _posted_any
    cdef dict _held
    cdef set _abandoned
    cdef set _finished
    cdef object _finished_order
    cdef dict _failed_keys
    cdef dict _dead
    cdef long long _order
    cdef dict _floors
    # (as a Python object's: a test or a tool may wrap a method of one mailbox, e.g. to watch
    # deliveries; calls between the mailbox's own methods stay in C)
    cdef dict __dict__

    cdef long long _next_order(self)
    cdef object _find_held(self, src, tuple key)
    cdef _Held _take_held(self, tuple key, held_src)
    cdef void _deliver_held(self, src, tuple key, _Held held, buf, fp, fut) except *
    cdef object _match(self, src, tuple key, Py_ssize_t nbytes, fp)
    cdef object _check(self, src, tuple key, sent_fp, want_fp, Py_ssize_t nbytes, Py_ssize_t bufbytes)
    cdef dict _drop_held(self, tuple key)
