"""Matching: arriving messages paired with posted receives, in order, checked against each other.

A message is addressed by a ``Key`` ``(group_id, channel, n)``: collectives use
``(gid, COLL, seq)``, point-to-point uses ``(gid, P2P, tag)``. Messages from one source with one
key are matched in the order they were sent (non-overtaking, as MPI); different keys never wait
on each other. A receive is *posted* with the buffer its payload must land in; a message that
arrives before its receive is held in a bounded unexpected store. A receive posted with a
fingerprint only accepts a message with an equal one; a disagreement fails the receive with a
``CollectiveMismatchError`` naming both sides.

``Mailbox`` here is the Python engine's matcher and the reference for its compiled twin
(``_matching.pyx``); ``new_mailbox`` makes whichever this process runs (``aiodist.native``).
Both satisfy ``Matcher``, and both hand out receives that satisfy ``Receive``.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
from collections import deque
from collections.abc import Callable
from typing import Literal, Protocol

from aiodist.errors import CollectiveMismatchError, DistError
from aiodist.native import compiled
from aiodist.runtime.origin import OriginBook
from aiodist.settings import UNEXPECTED_CAP
from aiodist.wire.fingerprint import ORDER_HINT, Fingerprint, OpFingerprint, describe_all
from aiodist.wire.messages import Key

__all__ = [
    "COLL",
    "CTRL",
    "DISCARD",
    "Discard",
    "P2P",
    "Mailbox",
    "Matcher",
    "PendingRecv",
    "Receive",
    "describe_disagreement",
    "describe_fingerprint",
    "check",
    "new_mailbox",
]

# channels of a Key
COLL = 0
P2P = 1
CTRL = 2  # group-internal control traffic (e.g. DETAIL-mode checks)

# How many completed collectives each mailbox remembers, to recognise their late messages.
FINISHED_KEPT = 4096


def describe_fingerprint(fp: Fingerprint | None) -> str:
    """A human reading of a fingerprint: ``all_reduce #3 (float32 x 10, sum)``, ``barrier #0``."""
    typed = OpFingerprint.from_wire(fp)
    return "an untagged message" if typed is None else typed.describe()


def describe_disagreement(
    receiver: int, want: Fingerprint | None, sender: int, sent: Fingerprint | None
) -> str:
    """``rank 0 expected all_reduce #3 (...) but rank 1 sent broadcast #3 (...)``; the tasks
    that started them are named where they differ, with what to do about it."""
    (wanted, got), only_origin = describe_all([want, sent])
    text = f"rank {receiver} expected {wanted} but rank {sender} sent {got}"
    return f"{text}: {ORDER_HINT}" if only_origin else text


class Receive(Protocol):
    """A posted receive as a transport sees it (``PendingRecv``, or its compiled twin)."""

    @property
    def src(self) -> int | None: ...
    @property
    def key(self) -> Key: ...
    @property
    def buf(self) -> memoryview: ...
    @property
    def fp(self) -> Fingerprint | None: ...
    @property
    def order(self) -> int: ...
    @property
    def future(self) -> asyncio.Future[int]: ...


class Matcher(Protocol):
    """A transport's mailbox: ``Mailbox`` or its compiled twin (see ``Mailbox`` for each method)."""

    rank: int
    unexpected_cap: int
    unexpected_bytes: int
    on_drain: Callable[[], None] | None
    on_post: Callable[[], None] | None
    on_late: Callable[[int, Key, Fingerprint | None], None] | None
    origin_books: dict[int, OriginBook]

    def post(
        self, src: int | None, key: Key, buf: memoryview, fp: Fingerprint | None = None
    ) -> asyncio.Future[int]: ...
    def repost(self, recv: Receive) -> None: ...
    def cancel(self, fut: asyncio.Future[int]) -> None: ...
    def match(self, src: int, key: Key, nbytes: int, fp: Fingerprint | None) -> Receive | Discard | None: ...
    def finish(self, key: Key) -> tuple[int, Fingerprint | None] | None: ...
    def complete(self, recv: Receive, src: int) -> None: ...
    def deliver(
        self, src: int, key: Key, fp: Fingerprint | None, payload: memoryview, *, owned: bool
    ) -> None: ...
    @property
    def over_cap(self) -> bool: ...
    def abandon(self, key: Key) -> None: ...
    def set_floor(self, gid: int, floor: int) -> None: ...
    def was_finished(self, key: Key) -> bool: ...
    def was_abandoned(self, key: Key) -> bool: ...
    def fail_key(self, key: Key, exc: BaseException) -> None: ...
    def failure(self, key: Key) -> BaseException | None: ...
    def fail_peer(self, src: int, exc: BaseException) -> None: ...
    def fail_all(self, exc: BaseException) -> None: ...
    def waiting_on(self, key: Key) -> list[int | None]: ...


def new_mailbox(
    rank: int,
    loop: asyncio.AbstractEventLoop,
    unexpected_cap: int = UNEXPECTED_CAP,
    on_mismatch: Callable[[int, Key, Fingerprint | None, Fingerprint | None], None] | None = None,
) -> Matcher:
    """The mailbox of the engine this process runs: the compiled twin of ``Mailbox`` where it
    was built (``aiodist.native``), else ``Mailbox``.

    Raises:
        DistError: ``AIODIST_NATIVE=1`` and the compiled matcher is not built.
    """
    native = compiled("aiodist.transport._matching")
    make = Mailbox if native is None else native.Mailbox
    box: Matcher = make(rank, loop, unexpected_cap, on_mismatch)
    return box


class PendingRecv:
    """A posted receive: where the payload goes and who is told when it has arrived."""

    __slots__ = ("buf", "fp", "future", "key", "order", "src")

    def __init__(
        self,
        src: int | None,
        key: Key,
        buf: memoryview,
        fp: Fingerprint | None,
        order: int,
        future: asyncio.Future[int],
    ) -> None:
        self.src = src
        self.key = key
        self.buf = buf
        self.fp = fp
        self.order = order
        self.future = future


class _Held:
    """A message that arrived before its receive was posted."""

    __slots__ = ("fp", "order", "payload")

    def __init__(self, fp: Fingerprint | None, payload: memoryview, order: int) -> None:
        self.fp = fp
        self.payload = payload
        self.order = order


class Discard(enum.Enum):
    """The type of ``DISCARD``."""

    DISCARD = 0


DISCARD: Literal[Discard.DISCARD] = Discard.DISCARD  # from match(): read the payload and drop it


def _fail_future(fut: asyncio.Future[int], exc: BaseException) -> None:
    """Fail a receive's future. A failure often reaches receives that their operation no
    longer awaits (it failed on another step first): mark it retrieved, so that asyncio
    does not log it as lost; whoever awaits it still gets the exception."""
    fut.set_exception(exc)
    fut.exception()


def check(
    box: Matcher,
    on_mismatch: Callable[[int, Key, Fingerprint | None, Fingerprint | None], None] | None,
    src: int,
    key: Key,
    sent_fp: Fingerprint | None,
    want_fp: Fingerprint | None,
    nbytes: int,
    bufbytes: int,
) -> DistError | None:
    """Why a message from ``src`` may not fill a receive: its fingerprint disagrees with the
    receive's (``on_mismatch`` is told) or its size differs from the buffer's; None if it may.
    (Both engines' mailboxes; the compiled one calls it only where its quick test failed.)"""
    if (
        want_fp is not None
        and sent_fp is not None
        and list(sent_fp) != list(want_fp)
        and _differ(box, key, sent_fp, want_fp)
    ):
        if on_mismatch is not None:
            on_mismatch(src, key, sent_fp, want_fp)
        return CollectiveMismatchError(describe_disagreement(box.rank, want_fp, src, sent_fp))
    if nbytes != bufbytes:
        what = describe_fingerprint(want_fp or sent_fp)
        return CollectiveMismatchError(
            f"rank {src} sent {nbytes} bytes for {what} but rank {box.rank} posted a buffer of {bufbytes} bytes"
        )
    return None


def _differ(box: Matcher, key: Key, sent: Fingerprint, want: Fingerprint) -> bool:
    """Unequal fingerprints disagree, unless only their origins differ and the group's book
    finds no race in that (``OriginBook.clash``: e.g. ranks running different code)."""
    if len(sent) != 7 or len(want) != 7 or list(sent[:6]) != list(want[:6]):
        return True
    book = box.origin_books.get(key[0])
    return book is None or book.clash(str(want[6]), str(sent[6]))


class Mailbox:
    """Matches arriving messages to posted receives. Pure bookkeeping, no I/O.

    Owned by one transport and used only from its event loop.
    """

    def __init__(
        self,
        rank: int,
        loop: asyncio.AbstractEventLoop,
        unexpected_cap: int = UNEXPECTED_CAP,
        on_mismatch: Callable[[int, Key, Fingerprint | None, Fingerprint | None], None] | None = None,
    ) -> None:
        self.rank = rank
        self.loop = loop
        self.unexpected_cap = unexpected_cap
        self.unexpected_bytes = 0
        self.on_mismatch = on_mismatch
        # Called when held messages were consumed or dropped, and when a receive is queued
        # (a transport that stopped reading at a message it had no room for looks again).
        self.on_drain: Callable[[], None] | None = None
        self.on_post: Callable[[], None] | None = None
        self._posted: dict[tuple[int, Key], deque[Receive]] = {}
        self._posted_any: dict[Key, deque[Receive]] = {}
        # Unexpected messages by key, then sender: a collective's completion looks up its own
        # key (a sender far ahead can leave thousands held; none may be scanned per operation).
        self._held: dict[Key, dict[int, deque[_Held]]] = {}
        self._abandoned: set[Key] = set()
        # Collectives completed here, most recent last: in a well-formed program every message
        # of a collective is received within it, so one arriving later means ranks disagreed.
        self._finished: set[Key] = set()
        self._finished_order: deque[Key] = deque()
        self.on_late: Callable[[int, Key, Fingerprint | None], None] | None = None
        self._failed_keys: dict[Key, BaseException] = {}
        self._dead: dict[int, BaseException] = {}
        self._order = itertools.count()
        # Per group id: messages of its collectives (and their checks) numbered below this are
        # stale (a resync moved every rank past them) and are discarded.
        self._floors: dict[int, int] = {}
        # Per group id: the tasks that started its collectives here, and when differing origins
        # of paired operations are a mismatch (the group's; shared with the transport).
        self.origin_books: dict[int, OriginBook] = {}

    # -- receiving side: posting ---------------------------------------------------------
    def post(
        self, src: int | None, key: Key, buf: memoryview, fp: Fingerprint | None = None
    ) -> asyncio.Future[int]:
        """Post a receive into ``buf`` (a flat byte view). The future resolves to the source rank."""
        fut: asyncio.Future[int] = self.loop.create_future()
        if key in self._failed_keys:
            _fail_future(fut, self._failed_keys[key])
            return fut
        held_src = self._find_held(src, key)
        if held_src is not None:
            by_src = self._held[key]
            held = by_src[held_src].popleft()
            if not by_src[held_src]:
                del by_src[held_src]
                if not by_src:
                    del self._held[key]
            self.unexpected_bytes -= held.payload.nbytes
            if self.on_drain is not None:
                self.on_drain()
            self._deliver_held(held_src, key, held, buf, fp, fut)
            return fut
        if src is not None and src in self._dead:
            _fail_future(fut, self._dead[src])
            return fut
        recv = PendingRecv(src, key, buf, fp, next(self._order), fut)
        if src is None:
            self._posted_any.setdefault(key, deque()).append(recv)
        else:
            self._posted.setdefault((src, key), deque()).append(recv)
        if self.on_post is not None:
            self.on_post()
        return fut

    def repost(self, recv: Receive) -> None:
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
            by_src = self._held[recv.key]
            held = by_src[held_src].popleft()
            if not by_src[held_src]:
                del by_src[held_src]
                if not by_src:
                    del self._held[recv.key]
            self.unexpected_bytes -= held.payload.nbytes
            if self.on_drain is not None:
                self.on_drain()
            self._deliver_held(held_src, recv.key, held, recv.buf, recv.fp, fut)
            return
        if recv.src is not None and recv.src in self._dead:
            _fail_future(fut, self._dead[recv.src])
            return
        if recv.src is None:
            q = self._posted_any.setdefault(recv.key, deque())
        else:
            q = self._posted.setdefault((recv.src, recv.key), deque())
        at = next((i for i, other in enumerate(q) if other.order > recv.order), len(q))
        q.insert(at, recv)
        if self.on_post is not None:
            self.on_post()

    def cancel(self, fut: asyncio.Future[int]) -> None:
        """Withdraw a posted receive that has not been matched yet (timeout, cancellation)."""
        for table in (self._posted, self._posted_any):
            for k, q in list(table.items()):
                for recv in q:
                    if recv.future is fut:
                        q.remove(recv)
                        if not q:
                            del table[k]  # type: ignore[arg-type]
                        return

    def _find_held(self, src: int | None, key: Key) -> int | None:
        by_src = self._held.get(key)
        if not by_src:
            return None
        if src is not None:
            return src if src in by_src else None
        return _earliest(by_src)

    def _deliver_held(
        self,
        src: int,
        key: Key,
        held: _Held,
        buf: memoryview,
        fp: Fingerprint | None,
        fut: asyncio.Future[int],
    ) -> None:
        err = check(self, self.on_mismatch, src, key, held.fp, fp, held.payload.nbytes, buf.nbytes)
        if err is not None:
            _fail_future(fut, err)
            return
        buf[:] = held.payload
        fut.set_result(src)

    # -- receiving side: arrivals ------------------------------------------------------
    def match(self, src: int, key: Key, nbytes: int, fp: Fingerprint | None) -> Receive | Discard | None:
        """A message header arrived from ``src``.

        Returns the posted receive whose buffer the payload goes into, ``DISCARD`` when the
        payload must be read and dropped, or None when it must be held as unexpected.
        """
        if key in self._abandoned:
            return DISCARD
        if self._floors and key[1] != P2P and key[2] < self._floors.get(key[0], 0):
            return DISCARD
        specific = self._posted.get((src, key))
        anyq = self._posted_any.get(key)
        if specific and (not anyq or specific[0].order < anyq[0].order):
            recv = specific.popleft()
            if not specific:
                del self._posted[(src, key)]
        elif anyq:
            recv = anyq.popleft()
            if not anyq:
                del self._posted_any[key]
        else:
            return None
        err = check(self, self.on_mismatch, src, key, fp, recv.fp, nbytes, recv.buf.nbytes)
        if err is not None:
            if not recv.future.done():
                _fail_future(recv.future, err)
            return DISCARD
        return recv

    def finish(self, key: Key) -> tuple[int, Fingerprint | None] | None:
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
        return src, by_src[src][0].fp

    def complete(self, recv: Receive, src: int) -> None:
        if not recv.future.done():
            recv.future.set_result(src)

    def deliver(
        self, src: int, key: Key, fp: Fingerprint | None, payload: memoryview, *, owned: bool
    ) -> None:
        """A whole message is here: hand it to a posted receive, or hold it until one is posted.

        Also the end of a TCP payload that had no receive when its header arrived: one may
        have been posted while the payload streamed in, and it must get this message, not
        wait behind it. ``owned``: ``payload`` is ours to keep (else a held copy is made).
        """
        target = self.match(src, key, payload.nbytes, fp)
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
            self._held.setdefault(key, {}).setdefault(src, deque()).append(_Held(fp, held, next(self._order)))
            self.unexpected_bytes += held.nbytes
            return
        target.buf[:] = payload
        self.complete(target, src)

    @property
    def over_cap(self) -> bool:
        return self.unexpected_bytes > self.unexpected_cap

    # -- failures and abandonment ------------------------------------------------------
    def abandon(self, key: Key) -> None:
        """Forget an operation that timed out: drop what it holds and whatever arrives for it later."""
        self._abandoned.add(key)
        self._drop_held(key)
        for table_key in [k for k in self._posted if k[1] == key]:
            del self._posted[table_key]
        self._posted_any.pop(key, None)

    def set_floor(self, gid: int, floor: int) -> None:
        """Discard group ``gid``'s collective messages numbered below ``floor``, held and to come."""
        self._floors[gid] = max(floor, self._floors.get(gid, 0))
        for key in [k for k in self._held if k[0] == gid and k[1] != P2P and k[2] < floor]:
            self._drop_held(key)

    def _drop_held(self, key: Key) -> dict[int, deque[_Held]]:
        """Forget every message held for ``key``: their bytes stop counting against the cap, and
        a reader paused at the cap is told (``on_drain``). Returns them by sender."""
        by_src = self._held.pop(key, None)
        if not by_src:
            return {}
        self.unexpected_bytes -= sum(h.payload.nbytes for q in by_src.values() for h in q)
        if self.on_drain is not None:
            self.on_drain()
        return by_src

    def was_finished(self, key: Key) -> bool:
        """The collective ``key`` completed here (among the last few thousand)."""
        return key in self._finished

    def was_abandoned(self, key: Key) -> bool:
        """The operation ``key`` failed or timed out here; its messages are discarded."""
        return key in self._abandoned

    def fail_key(self, key: Key, exc: BaseException) -> None:
        """Fail every receive posted for ``key`` now and later (the peer reported a mismatch)."""
        self._failed_keys[key] = exc
        for table_key in [k for k in self._posted if k[1] == key]:
            for recv in self._posted.pop(table_key):
                if not recv.future.done():
                    _fail_future(recv.future, exc)
        for recv in self._posted_any.pop(key, ()):
            if not recv.future.done():
                _fail_future(recv.future, exc)

    def failure(self, key: Key) -> BaseException | None:
        """What a peer reported about the operation ``key`` (``fail_key``), if it did."""
        return self._failed_keys.get(key)

    def fail_peer(self, src: int, exc: BaseException) -> None:
        """``src`` is gone: fail every receive waiting on it, now and later."""
        self._dead.setdefault(src, exc)
        for table_key in [k for k in self._posted if k[0] == src]:
            for recv in self._posted.pop(table_key):
                if not recv.future.done():
                    _fail_future(recv.future, exc)

    def fail_all(self, exc: BaseException) -> None:
        for q in itertools.chain(self._posted.values(), self._posted_any.values()):
            for recv in q:
                if not recv.future.done():
                    _fail_future(recv.future, exc)
        self._posted.clear()
        self._posted_any.clear()

    def waiting_on(self, key: Key) -> list[int | None]:
        """Sources whose messages for ``key`` are still awaited (for timeout messages)."""
        srcs: list[int | None] = [
            s for s in sorted({k[0] for k, q in self._posted.items() if k[1] == key and q})
        ]
        if self._posted_any.get(key):
            srcs.append(None)
        return srcs


def _earliest(by_src: dict[int, deque[_Held]]) -> int:
    """The sender whose held message arrived first."""
    return min(by_src, key=lambda s: by_src[s][0].order)
