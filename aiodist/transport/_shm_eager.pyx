# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled twins of ``aiodist.transport.shm_eager``: ``take_eager`` (the same records taken,
the same deliveries, in one C loop per wake-up) and ``write_eager`` (the same record written).

Per message it reads the ring's record in place (``Ring._next``), the binary header, the shape
table's entry, asks the matcher in C (``Mailbox._match``), copies the payload into the receive's
buffer with ``memcpy`` and completes the receive's future; no Python frame runs. Anything it does
not take the Python way round (a shape never defined: ``ShapeReader.data`` raises the error the
general reader would) is left to the twin's callers exactly as the twin leaves it.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy

from aiodist.transport._matching cimport Mailbox, PendingRecv
from aiodist.transport._shm_ring cimport Ring

from aiodist.transport.matching import DISCARD
from aiodist.wire.shm import BIN_DATA, BIN_TAG

__all__ = ["runs_on", "take_eager", "write_eager", "writes"]

cdef Py_ssize_t _BIN_SIZE = BIN_DATA.size
cdef uint8_t _BIN_TAG = BIN_TAG
cdef Py_ssize_t _COLLECTIVE_ITEMS = 7  # (wire.shm: a collective's fingerprint, its seq at 1)
cdef Py_ssize_t _SEQ = 1


cdef uint32_t _ONE = 1
# (the binary header is little-endian, and these write and read it in the host's order)
cdef bint _LITTLE_ENDIAN = (<unsigned char *>&_ONE)[0] == 1


def writes(ring):
    """Whether ``write_eager`` can write into ``ring`` (compiled, on a little-endian host)."""
    return _LITTLE_ENDIAN and type(ring) is Ring


def runs_on(ring, mailbox):
    """Whether these twins can serve ``ring`` and ``mailbox``: both compiled, on a
    little-endian host."""
    return _LITTLE_ENDIAN and type(ring) is Ring and type(mailbox) is Mailbox


def take_eager(Ring ring, shapes, Mailbox mailbox, peer):
    """See ``shm_eager.take_eager``."""
    cdef Py_ssize_t start
    cdef uint32_t hlen, rlen, sid
    cdef uint64_t plen
    cdef uint8_t chan
    cdef int64_t gid, n, seq
    cdef const unsigned char *hdr
    cdef Py_ssize_t taken = 0
    cdef Py_ssize_t delivered = 0
    cdef list table = shapes._shapes
    cdef PendingRecv recv
    cdef Py_buffer view
    while ring._next(&start, &hlen, &plen, &rlen):
        hdr = ring._base + start
        if hlen != _BIN_SIZE or hdr[0] != _BIN_TAG:
            break
        chan = hdr[1]
        memcpy(&sid, hdr + 4, 4)
        memcpy(&gid, hdr + 8, 8)
        memcpy(&n, hdr + 16, 8)
        memcpy(&seq, hdr + 24, 8)
        if sid >= <uint32_t>len(table):
            shapes.data(ring.data[start : start + hlen])  # (raises the twin's error)
            break
        shape = table[sid]
        if shape is None:
            fp = None
        else:
            fp = list(shape)
            if len(<list>fp) == _COLLECTIVE_ITEMS:
                fp[_SEQ] = seq
        key = (gid, chan, n)
        target = mailbox._match(peer, key, <Py_ssize_t>plen, fp)
        if target is None:
            break
        if target is not DISCARD:
            recv = <PendingRecv>target
            if PyObject_GetBuffer(recv.buf, &view, PyBUF_WRITABLE) == 0:
                try:
                    if plen:  # (match checked that the sizes agree)
                        memcpy(view.buf, hdr + hlen, plen)
                finally:
                    PyBuffer_Release(&view)
            delivered += plen
            fut = recv.future
            if not fut.done():
                fut.set_result(peer)
        ring._advance(rlen)
        taken += 1
    return taken, delivered


cdef int64_t _to_i64(x, bint *ok):
    """``x`` as a signed 64-bit integer (as ``struct``'s "q": an int or a bool); ``ok`` false
    where it is not one in range."""
    if not isinstance(x, int):
        ok[0] = False
        return 0
    try:
        return <int64_t>x
    except OverflowError:
        ok[0] = False
        return 0


def write_eager(Ring ring, shapes, tuple key, fp, payload):
    """See ``shm_eager.write_eager``."""
    cdef unsigned char hdr[32]
    cdef bint ok = True
    cdef Py_ssize_t items
    cdef uint32_t sid32
    cdef int64_t gid, n, seq = 0
    cdef Py_buffer p
    chan = key[1]
    if not isinstance(chan, int) or not 0 <= chan <= 255:
        return -1
    if fp is None:
        sid = 0
    else:
        items = len(fp)
        if items == _COLLECTIVE_ITEMS:
            seq = _to_i64(fp[_SEQ], &ok)
            shape = (fp[0], None, *fp[2:])
        else:
            shape = tuple(fp)
        try:
            sid = (<dict>shapes._ids).get(shape, 0)
        except TypeError:  # (an item that is not hashable)
            return -1
        if not sid:
            return -1  # (a new shape: the Python writer defines it)
    gid = _to_i64(key[0], &ok)
    n = _to_i64(key[2], &ok)
    if not ok:
        return -1  # (a number beyond 64 bits: msgpack carries it)
    sid32 = <uint32_t>sid
    hdr[0] = _BIN_TAG
    hdr[1] = <uint8_t>chan
    hdr[2] = 0
    hdr[3] = 0
    memcpy(hdr + 4, &sid32, 4)  # (little-endian, as BIN_DATA: runs_on checks the host)
    memcpy(hdr + 8, &gid, 8)
    memcpy(hdr + 16, &n, 8)
    memcpy(hdr + 24, &seq, 8)
    PyObject_GetBuffer(payload, &p, PyBUF_SIMPLE)
    try:
        return 1 if ring._write(hdr, 32, <const unsigned char *>p.buf, p.len) else 0
    finally:
        PyBuffer_Release(&p)
