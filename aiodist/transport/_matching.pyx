# cython: language_level=3, boundscheck=False, wraparound=False
"""The compiled twin of ``aiodist.transport.matching.Mailbox``: the same matching, in C.

Same interface, same answers, same errors: the differential tests (tests/unit/test_native_matching.py)
give both twins the same sequences of posts, arrivals and failures and demand the same outcomes.
What differs is what a message costs: the tables are the same Python dicts and deques, but they
are reached through the C API, a receive is a C struct with a Python face, and the fingerprint
and size check runs in C where the two agree (every case but a mismatch, which calls the Python
``check`` for its error, so that both twins word it alike).
"""

from collections import deque

from aiodist.settings import UNEXPECTED_CAP
from aiodist.transport.matching import DISCARD, FINISHED_KEPT, P2P, check

__all__ = ["Mailbox", "PendingRecv"]


cdef class PendingRecv:
    """A posted receive: where the payload goes and who is told when it has arrived."""

    def __init__(self, src, tuple key, buf, fp, long long order, future):
        self.src = src
        self.key = key
        self.buf = buf
        self.fp = fp
        self.order = order
        self.future = future
        self.nbytes = buf.nbytes


cdef class _Held:
    """A message that arrived before its receive was posted."""

    def __init__(self, fp, payload, long long order):
        self.fp = fp
        self.payload = payload
        self.order = order
        self.nbytes = payload.nbytes


cdef inline void _fail_future(fut, exc):
    # (marked retrieved: see matching._fail_future)
    fut.set_exception(exc)
    fut.exception()


cdef bint same_fp(sent, want) except -1:
    """``list(sent) == list(want)`` without the copies where both are lists (the common case).
    (Declared in _matching.pxd: the compiled readers compare fingerprints with it too.)"""
    if type(sent) is list and type(want) is list:
        return sent == want
    return list(sent) == list(want)


cdef object _earliest(dict by_src):
    """The sender whose held message arrived first."""
    cdef object best = None
    cdef long long best_order = 0
    cdef _Held h
    for s, q in by_src.items():
        h = <_Held>(q[0])
        if best is None or h.order < best_order:
            best, best_order = s, h.order
    return best


cdef class Mailbox:
    """Matches arriving messages to posted receives. Pure bookkeeping, no I/O.

    Owned by one transport and used only from its event loop. (Its fields are declared in
    _matching.pxd, for the compiled readers that share it.)
    """

    def __init__(self, rank, loop, unexpected_cap=UNEXPECTED_CAP, on_mismatch=None):
        self.rank = rank
        self.loop = loop
        self.unexpected_cap = unexpected_cap
        self.unexpected_bytes = 0
        self.on_mismatch = on_mismatch
        self.on_drain = None
        self.on_post = None
        self.on_late = None
        self.origin_books = {}
        self._posted = {}
        self._posted_any = {}
        self._held = {}
        self._abandoned = set()
        self._finished = set()
        self._finished_order = deque()
        self._failed_keys = {}
        self._dead = {}
        self._order = 0
        self._floors = {}

    cdef long long _next_order(self):
        cdef long long n = self._order
        self._order += 1
        return n

    # -- receiving side: posting ---------------------------------------------------------
    def post(self, src, tuple key, buf, fp=None):
        """Post a receive into ``buf`` (a flat byte view). The future resolves to the source rank."""
        fut = self.loop.create_future()
        if key in self._failed_keys:
            _fail_future(fut, self._failed_keys[key])
            return fut
        if self._held:
            held_src = self._find_held(src, key)
            if held_src is not None:
                held = self._take_held(key, held_src)
                self._deliver_held(held_src, key, held, buf, fp, fut)
                return fut
        if src is not None and src in self._dead:
            _fail_future(fut, self._dead[src])
            return fut
        recv = PendingRecv(src, key, buf, fp, self._next_order(), fut)
        cdef object q
        if src is None:
            q = self._posted_any.get(key)
            if q is None:
                q = self._posted_any[key] = deque()
        else:
            table_key = (src, key)
            q = self._posted.get(table_key)
            if q is None:
                q = self._posted[table_key] = deque()
        q.append(recv)
        if self.on_post is not None:
            self.on_post()
        return fut

    def repost(self, PendingRecv recv):
        """``recv`` was matched to a message its sender then withdrew (the send failed): it
        waits again, first in line (before the receives posted after it), or takes a message
        held meanwhile."""
        fut = recv.future
        if fut.done() or recv.key in self._abandoned:
            return
        if recv.key in self._failed_keys:
            _fail_future(fut, self._failed_keys[recv.key])
            return
        held_src = self._find_held(recv.src, recv.key)
        if held_src is not None:
            held = self._take_held(recv.key, held_src)
            self._deliver_held(held_src, recv.key, held, recv.buf, recv.fp, fut)
            return
        if recv.src is not None and recv.src in self._dead:
            _fail_future(fut, self._dead[recv.src])
            return
        if recv.src is None:
            q = self._posted_any.setdefault(recv.key, deque())
        else:
            q = self._posted.setdefault((recv.src, recv.key), deque())
        cdef Py_ssize_t at = len(q)
        cdef Py_ssize_t i = 0
        cdef PendingRecv other
        for o in q:
            other = <PendingRecv>o
            if other.order > recv.order:
                at = i
                break
            i += 1
        q.insert(at, recv)
        if self.on_post is not None:
            self.on_post()

    def cancel(self, fut):
        """Withdraw a posted receive that has not been matched yet (timeout, cancellation)."""
        cdef PendingRecv recv
        for table in (self._posted, self._posted_any):
            for k, q in list(table.items()):
                for r in q:
                    recv = <PendingRecv>r
                    if recv.future is fut:
                        q.remove(recv)
                        if not q:
                            del table[k]
                        return

    cdef object _find_held(self, src, tuple key):
        by_src = self._held.get(key)
        if not by_src:
            return None
        if src is not None:
            return src if src in by_src else None
        return _earliest(by_src)

    cdef _Held _take_held(self, tuple key, held_src):
        """Take the first message held for ``key`` from ``held_src`` (there is one)."""
        by_src = <dict>self._held[key]
        q = by_src[held_src]
        cdef _Held held = <_Held>q.popleft()
        if not q:
            del by_src[held_src]
            if not by_src:
                del self._held[key]
        self.unexpected_bytes -= held.nbytes
        if self.on_drain is not None:
            self.on_drain()
        return held

    cdef void _deliver_held(self, src, tuple key, _Held held, buf, fp, fut) except *:
        err = self._check(src, key, held.fp, fp, held.nbytes, buf.nbytes)
        if err is not None:
            _fail_future(fut, err)
            return
        buf[:] = held.payload
        fut.set_result(src)

    # -- receiving side: arrivals ------------------------------------------------------
    def match(self, src, tuple key, Py_ssize_t nbytes, fp):
        """A message header arrived from ``src``.

        Returns the posted receive whose buffer the payload goes into, ``DISCARD`` when the
        payload must be read and dropped, or None when it must be held as unexpected.
        """
        return self._match(src, key, nbytes, fp)

    cdef object _match(self, src, tuple key, Py_ssize_t nbytes, fp):
        if self._abandoned and key in self._abandoned:
            return DISCARD
        if self._floors and key[1] != P2P and key[2] < self._floors.get(key[0], 0):
            return DISCARD
        cdef PendingRecv recv
        table_key = (src, key)
        specific = self._posted.get(table_key)
        anyq = self._posted_any.get(key) if self._posted_any else None
        if specific and (not anyq or (<PendingRecv>specific[0]).order < (<PendingRecv>anyq[0]).order):
            recv = <PendingRecv>specific.popleft()
            if not specific:
                del self._posted[table_key]
        elif anyq:
            recv = <PendingRecv>anyq.popleft()
            if not anyq:
                del self._posted_any[key]
        else:
            return None
        err = self._check(src, key, fp, recv.fp, nbytes, recv.nbytes)
        if err is not None:
            if not recv.future.done():
                _fail_future(recv.future, err)
            return DISCARD
        return recv

    cdef object _check(self, src, tuple key, sent_fp, want_fp, Py_ssize_t nbytes, Py_ssize_t bufbytes):
        if nbytes == bufbytes and (want_fp is None or sent_fp is None or same_fp(sent_fp, want_fp)):
            return None
        return check(self, self.on_mismatch, src, key, sent_fp, want_fp, nbytes, bufbytes)

    def finish(self, tuple key):
        """The collective ``key`` completed here. Returns a message still held for it (sender,
        fingerprint), which means the ranks disagreed about the operation, or None."""
        self._finished.add(key)
        self._finished_order.append(key)
        if len(self._finished_order) > FINISHED_KEPT:
            self._finished.discard(self._finished_order.popleft())
        by_src = self._drop_held(key)  # (every sender's: none will be received now)
        if not by_src:
            return None
        src = _earliest(by_src)
        return src, (<_Held>by_src[src][0]).fp

    def complete(self, PendingRecv recv, src):
        fut = recv.future
        if not fut.done():
            fut.set_result(src)

    def deliver(self, src, tuple key, fp, payload, *, owned):
        """A whole message is here: hand it to a posted receive, or hold it until one is posted.

        Also the end of a TCP payload that had no receive when its header arrived: one may
        have been posted while the payload streamed in, and it must get this message, not
        wait behind it. ``owned``: ``payload`` is ours to keep (else a held copy is made).
        """
        target = self._match(src, key, payload.nbytes, fp)
        if target is DISCARD:
            return
        if target is None:
            if key in self._abandoned:
                return
            if key in self._finished:
                if self.on_late is not None:
                    self.on_late(src, key, fp)
                return
            held = payload if owned else memoryview(bytearray(payload))
            by_src = self._held.get(key)
            if by_src is None:
                by_src = self._held[key] = {}
            q = by_src.get(src)
            if q is None:
                q = by_src[src] = deque()
            entry = _Held(fp, held, self._next_order())
            q.append(entry)
            self.unexpected_bytes += entry.nbytes
            return
        recv = <PendingRecv>target
        recv.buf[:] = payload
        fut = recv.future
        if not fut.done():
            fut.set_result(src)

    @property
    def over_cap(self):
        return self.unexpected_bytes > self.unexpected_cap

    # -- failures and abandonment ------------------------------------------------------
    def abandon(self, tuple key):
        """Forget an operation that timed out: drop what it holds and whatever arrives for it later."""
        self._abandoned.add(key)
        self._drop_held(key)
        for table_key in [k for k in self._posted if k[1] == key]:
            del self._posted[table_key]
        self._posted_any.pop(key, None)

    def set_floor(self, gid, floor):
        """Discard group ``gid``'s collective messages numbered below ``floor``, held and to come."""
        self._floors[gid] = max(floor, self._floors.get(gid, 0))
        for key in [k for k in self._held if k[0] == gid and k[1] != P2P and k[2] < floor]:
            self._drop_held(key)

    cdef dict _drop_held(self, tuple key):
        """Forget every message held for ``key``: their bytes stop counting against the cap, and
        a reader paused at the cap is told (``on_drain``). Returns them by sender."""
        by_src = self._held.pop(key, None)
        if not by_src:
            return {}
        cdef Py_ssize_t n = 0
        for q in by_src.values():
            for h in q:
                n += (<_Held>h).nbytes
        self.unexpected_bytes -= n
        if self.on_drain is not None:
            self.on_drain()
        return by_src

    def was_finished(self, tuple key):
        """The collective ``key`` completed here (among the last few thousand)."""
        return key in self._finished

    def was_abandoned(self, tuple key):
        """The operation ``key`` failed or timed out here; its messages are discarded."""
        return key in self._abandoned

    def failure(self, tuple key):
        """What a peer reported about the operation ``key`` (``fail_key``), if it did."""
        return self._failed_keys.get(key)

    def fail_key(self, tuple key, exc):
        """Fail every receive posted for ``key`` now and later (the peer reported a mismatch)."""
        cdef PendingRecv recv
        self._failed_keys[key] = exc
        for table_key in [k for k in self._posted if k[1] == key]:
            for r in self._posted.pop(table_key):
                recv = <PendingRecv>r
                if not recv.future.done():
                    _fail_future(recv.future, exc)
        for r in self._posted_any.pop(key, ()):
            recv = <PendingRecv>r
            if not recv.future.done():
                _fail_future(recv.future, exc)

    def fail_peer(self, src, exc):
        """``src`` is gone: fail every receive waiting on it, now and later."""
        cdef PendingRecv recv
        self._dead.setdefault(src, exc)
        for table_key in [k for k in self._posted if k[0] == src]:
            for r in self._posted.pop(table_key):
                recv = <PendingRecv>r
                if not recv.future.done():
                    _fail_future(recv.future, exc)

    def fail_all(self, exc):
        cdef PendingRecv recv
        for table in (self._posted, self._posted_any):
            for q in table.values():
                for r in q:
                    recv = <PendingRecv>r
                    if not recv.future.done():
                        _fail_future(recv.future, exc)
        self._posted.clear()
        self._posted_any.clear()

    def waiting_on(self, tuple key):
        """Sources whose messages for ``key`` are still awaited (for timeout messages)."""
        srcs = [s for s in sorted({k[0] for k, q in self._posted.items() if k[1] == key and q})]
        if self._posted_any.get(key):
            srcs.append(None)
        return srcs
