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

from aiodist.transport._matching cimport Mailbox, PendingRecv, _Held, same_fp
from aiodist.transport._shm_ring cimport Ring

from collections import deque

from aiodist.transport.matching import DISCARD
from aiodist.wire.shm import BIN_DATA, BIN_TAG

__all__ = ["finish_mine", "post_mine", "runs_on", "take_eager", "take_mine", "withdraw_mine", "write_eager", "writes"]

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


cdef struct _Bin:
    # An eager data record's binary header (wire.shm.BIN_DATA), read.
    uint8_t chan
    uint32_t sid
    int64_t gid
    int64_t n
    int64_t seq


cdef inline bint _read_bin(const unsigned char *hdr, uint32_t hlen, _Bin *out) noexcept:
    """Read ``hdr`` into ``out`` if it is an eager data record's binary header (else False)."""
    if hlen != _BIN_SIZE or hdr[0] != _BIN_TAG:
        return False
    out.chan = hdr[1]
    memcpy(&out.sid, hdr + 4, 4)  # (little-endian, as BIN_DATA: runs_on checks the host)
    memcpy(&out.gid, hdr + 8, 8)
    memcpy(&out.n, hdr + 16, 8)
    memcpy(&out.seq, hdr + 24, 8)
    return True


cdef inline object _fp_of(list table, uint32_t sid, int64_t seq):
    """The fingerprint of a binary header: its shape (``sid`` in ``table``, which has it) with
    a collective's sequence number put back (as ``wire.shm.ShapeReader.data``)."""
    shape = table[sid]
    if shape is None:
        return None
    fp = list(shape)
    if len(<list>fp) == _COLLECTIVE_ITEMS:
        fp[_SEQ] = seq
    return fp


def runs_on(ring, mailbox):
    """Whether these twins can serve ``ring`` and ``mailbox``: both compiled, on a
    little-endian host."""
    return _LITTLE_ENDIAN and type(ring) is Ring and type(mailbox) is Mailbox


def take_eager(Ring ring, shapes, Mailbox mailbox, peer):
    """See ``shm_eager.take_eager``."""
    cdef Py_ssize_t start
    cdef uint32_t hlen, rlen
    cdef uint64_t plen
    cdef _Bin bin
    cdef const unsigned char *hdr
    cdef Py_ssize_t taken = 0
    cdef Py_ssize_t delivered = 0
    cdef list table = shapes._shapes
    cdef PendingRecv recv
    cdef Py_buffer view
    while ring._next(&start, &hlen, &plen, &rlen):
        hdr = ring._base + start
        if not _read_bin(hdr, hlen, &bin):
            break
        if bin.sid >= <uint32_t>len(table):
            shapes.data(ring.data[start : start + hlen])  # (raises the twin's error)
            break
        fp = _fp_of(table, bin.sid, bin.seq)
        key = (bin.gid, bin.chan, bin.n)
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


# -- a receive of a thread other than the loop's -------------------------------------------------
# A blocking receive may wait on its caller's thread (ShmPaths.recv_here) instead of hopping to
# the loop's. Each of these runs whole with the GIL held and calls no Python code (no callback of
# the mailbox, no future with callbacks), so the loop's thread sees the mailbox and the ring
# before or after one, never in between; the loop's thread may still fill the receive itself.


def post_mine(Mailbox box, src, tuple key, buf, fp):
    """Post a receive from ``src`` for the calling thread: its future, in line for ``key``
    behind the receives from ``src`` posted before it, or None where the receive must be
    posted the loop's way (a receive from any source waits for ``key``, its operation failed,
    ``src`` is gone, a message held for it disagrees). A message of ``src`` held for ``key``
    fills it at once (the future is done: the caller tells the mailbox's ``on_drain`` on the
    loop's thread)."""
    cdef _Held held
    if key in box._failed_keys or src in box._dead or key in box._abandoned:
        return None
    table_key = (src, key)
    if box._posted_any.get(key):
        return None
    q = box._posted.get(table_key)
    if q:  # (behind those: a message held for the key would have filled the first of them)
        fut = box.loop.create_future()
        q.append(PendingRecv(src, key, buf, fp, box._next_order(), fut))
        return fut
    by_src = box._held.get(key)
    q = by_src.get(src) if by_src else None
    if q:  # (messages held from other senders only are theirs, not this receive's)
        held = <_Held>q[0]
        if held.nbytes != buf.nbytes or (held.fp is not None and fp is not None and not same_fp(held.fp, fp)):
            return None
        q.popleft()
        if not q:
            del by_src[src]
            if not by_src:
                del box._held[key]
        box.unexpected_bytes -= held.nbytes
        buf[:] = held.payload
        fut = box.loop.create_future()
        fut.set_result(src)
        return fut
    fut = box.loop.create_future()
    box._posted[table_key] = deque([PendingRecv(src, key, buf, fp, box._next_order(), fut)])
    return fut


def take_mine(Ring ring, shapes, Mailbox box, src, tuple key, fut):
    """Take the record at the front of ``ring`` (``src``'s) if it is the message of the receive
    ``post_mine`` gave ``fut`` for, first in line for ``key``, agreeing in size and fingerprint: its bytes (``fut`` is
    then done), or -1 where it is not (an empty ring, another message, a disagreement: the
    loop's thread takes those)."""
    cdef Py_ssize_t start
    cdef uint32_t hlen, rlen
    cdef uint64_t plen
    cdef _Bin bin
    cdef const unsigned char *hdr
    cdef list table = shapes._shapes
    cdef PendingRecv recv
    cdef Py_buffer view
    if not ring._next(&start, &hlen, &plen, &rlen):
        return -1
    hdr = ring._base + start
    if not _read_bin(hdr, hlen, &bin):
        return -1
    if bin.sid >= <uint32_t>len(table) or (bin.gid, bin.chan, bin.n) != key:
        return -1
    table_key = (src, key)
    q = box._posted.get(table_key)
    if not q or box._posted_any.get(key):
        return -1
    recv = <PendingRecv>q[0]
    if recv.future is not fut or <Py_ssize_t>plen != recv.nbytes:
        return -1
    fp = _fp_of(table, bin.sid, bin.seq)
    if recv.fp is not None and fp is not None and not same_fp(recv.fp, fp):
        return -1
    q.popleft()
    if not q:
        del box._posted[table_key]
    PyObject_GetBuffer(recv.buf, &view, PyBUF_WRITABLE)
    try:
        if plen:
            memcpy(view.buf, hdr + hlen, plen)
    finally:
        PyBuffer_Release(&view)
    ring._advance(rlen)
    fut.set_result(src)
    return plen


def withdraw_mine(Mailbox box, src, tuple key, fut):
    """Take back the receive ``post_mine`` gave ``fut`` for: True if it was still waiting
    (nothing will fill it now); False if a message was matched to it (it completes soon)."""
    cdef PendingRecv recv
    table_key = (src, key)
    q = box._posted.get(table_key)
    if not q:
        return False
    for r in q:
        recv = <PendingRecv>r
        if recv.future is fut:
            q.remove(recv)
            if not q:
                del box._posted[table_key]
            return True
    return False


def finish_mine(Mailbox box, tuple key):
    """Mark the collective ``key`` finished here, from the calling thread: True; False (nothing
    done) where a message is still held for it, which the loop's thread must report late."""
    if box._held.get(key):
        return False
    box.finish(key)  # (nothing held: it calls no Python code)
    return True
