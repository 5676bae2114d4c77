"""The transport interface that every algorithm is written against, and its matching engine.

A transport moves *messages* between global ranks. A message is addressed by a ``Key``
``(group_id, channel, n)``: collectives use ``(gid, COLL, seq)``, point-to-point uses
``(gid, P2P, tag)``. Messages from one source with one key are matched in the order they
were sent (non-overtaking, as MPI); different keys never wait on each other, so any number
of operations can be in flight at once.

A receive is *posted* with the buffer its payload must land in. The ``Mailbox`` matches
arrivals against posted receives (a TCP payload is then read straight into that buffer);
a message that arrives before its receive is posted is held in a bounded unexpected store.
Every message may carry its operation's fingerprint; a receive posted with a fingerprint
only accepts a message with an equal one, and a disagreement fails the receive with a
``CollectiveMismatchError`` naming both sides (and tells the sender, through
``on_mismatch``: a collective fails there too; a refused point-to-point message is handed to
the sender's groups, ``add_send_refused_listener``).
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from aiodist.errors import CollectiveMismatchError, DistError, DistNetworkError, GroupOutOfStepError
from aiodist.runtime.origin import OriginBook
from aiodist.settings import UNEXPECTED_CAP, Settings
from aiodist.wire.control import Control, Goodbye
from aiodist.wire.fingerprint import ORDER_HINT, Fingerprint, OpFingerprint, describe_all
from aiodist.wire.messages import Key

__all__ = [
    "COLL",
    "CTRL",
    "P2P",
    "Fingerprint",
    "Key",
    "Mailbox",
    "Member",
    "PendingRecv",
    "Transport",
    "describe_disagreement",
    "describe_fingerprint",
    "LateMessageError",
]

# channels of a Key
COLL = 0
P2P = 1
CTRL = 2  # group-internal control traffic (e.g. DETAIL-mode checks)

# How many completed collectives each mailbox remembers, to recognise their late messages.
_FINISHED_KEPT = 4096

# Control messages kept for groups not created here yet: groups, and messages per group (a
# resync sends one proposal per member and retry; a state query one per timeout).
_EARLY_GROUPS_KEPT = 64
_EARLY_CONTROL_KEPT = 1024


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


def exit_goodbye() -> Goodbye:
    """How this process leaves when the interpreter exits (for the goodbye said at exit).

    An uncaught exception: Python prints its traceback and keeps it in ``sys.last_value``
    before the at-exit handlers run (not in an interactive session, where that is merely the
    last error shown). ``sys.exit`` with a non-zero code leaves no trace an at-exit handler
    can read, so it reads as the end of the program.
    """
    exc = getattr(sys, "last_value", None)
    if exc is not None and not hasattr(sys, "ps1") and not isinstance(exc, SystemExit | KeyboardInterrupt):
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return Goodbye("exception", text[:500])
    if isinstance(exc, KeyboardInterrupt):
        return Goodbye("exception", "KeyboardInterrupt")
    return Goodbye("exit")


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


DISCARD = object()  # sentinel from match(): read the payload and drop it

# Why a member abandoned an operation (abort notices): the error its peers raise.
ABORT_KINDS: dict[str, type[DistError]] = {
    "network": DistNetworkError,
    "mismatch": CollectiveMismatchError,
    "error": DistError,
    "out_of_step": GroupOutOfStepError,
}


def abort_kind(exc: BaseException) -> str:
    """The abort-notice kind for the error that made this rank abandon an operation."""
    if isinstance(exc, DistNetworkError):
        return "network"
    if isinstance(exc, CollectiveMismatchError):
        return "mismatch"
    if isinstance(exc, GroupOutOfStepError):
        return "out_of_step"
    return "error"


def _fail_future(fut: asyncio.Future[int], exc: BaseException) -> None:
    """Fail a receive's future. A failure often reaches receives that their operation no
    longer awaits (it failed on another step first): mark it retrieved, so that asyncio
    does not log it as lost; whoever awaits it still gets the exception."""
    fut.set_exception(exc)
    fut.exception()


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
        self._posted: dict[tuple[int, Key], deque[PendingRecv]] = {}
        self._posted_any: dict[Key, deque[PendingRecv]] = {}
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

    def repost(self, recv: PendingRecv) -> None:
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
        err = self._check(src, key, held.fp, fp, held.payload.nbytes, buf.nbytes)
        if err is not None:
            _fail_future(fut, err)
            return
        buf[:] = held.payload
        fut.set_result(src)

    # -- receiving side: arrivals ------------------------------------------------------
    def match(self, src: int, key: Key, nbytes: int, fp: Fingerprint | None) -> PendingRecv | object | None:
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
        err = self._check(src, key, fp, recv.fp, nbytes, recv.buf.nbytes)
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
        if len(self._finished_order) > _FINISHED_KEPT:
            self._finished.discard(self._finished_order.popleft())
        by_src = self._drop_held(key)  # (every sender's: none will be received now)
        if not by_src:
            return None
        src = _earliest(by_src)
        return src, by_src[src][0].fp

    def complete(self, recv: PendingRecv, src: int) -> None:
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
        assert isinstance(target, PendingRecv)
        target.buf[:] = payload
        self.complete(target, src)

    @property
    def over_cap(self) -> bool:
        return self.unexpected_bytes > self.unexpected_cap

    def _check(
        self,
        src: int,
        key: Key,
        sent_fp: Fingerprint | None,
        want_fp: Fingerprint | None,
        nbytes: int,
        bufbytes: int,
    ) -> DistError | None:
        if (
            want_fp is not None
            and sent_fp is not None
            and list(sent_fp) != list(want_fp)
            and self._differ(key, sent_fp, want_fp)
        ):
            if self.on_mismatch is not None:
                self.on_mismatch(src, key, sent_fp, want_fp)
            return CollectiveMismatchError(describe_disagreement(self.rank, want_fp, src, sent_fp))
        if nbytes != bufbytes:
            what = describe_fingerprint(want_fp or sent_fp)
            return CollectiveMismatchError(
                f"rank {src} sent {nbytes} bytes for {what} but rank {self.rank} posted a buffer of {bufbytes} bytes"
            )
        return None

    def _differ(self, key: Key, sent: Fingerprint, want: Fingerprint) -> bool:
        """Unequal fingerprints disagree, unless only their origins differ and the group's book
        finds no race in that (``OriginBook.clash``: e.g. ranks running different code)."""
        if len(sent) != 7 or len(want) != 7 or list(sent[:6]) != list(want[:6]):
            return True
        book = self.origin_books.get(key[0])
        return book is None or book.clash(str(want[6]), str(sent[6]))

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


class Member(Protocol):
    """A group as the transport sees it (``Transport.attach``): what it is told, and its book
    of the tasks that started its collectives (which a mismatch error quotes)."""

    origins: OriginBook

    def on_peer_gone(self, peer: int, exc: DistNetworkError) -> None:
        """``peer`` is gone, lost or left in order: told before the receives waiting on it fail
        (so that an operation can fail first, naming itself)."""

    def on_peer_lost(self, peer: int, exc: DistNetworkError) -> None:
        """``peer`` is lost (gone without a goodbye): told after its receives failed."""

    def on_key_failed(self, key: Key, exc: BaseException) -> None:
        """An operation of this group (``key``) failed elsewhere: a member's abort or mismatch."""

    def on_send_refused(
        self, peer: int, key: Key, fp: Fingerprint | None, exc: CollectiveMismatchError
    ) -> None:
        """``peer`` refused a point-to-point message of ours (its receive was posted for another
        size or dtype); ``fp`` is what this rank sent, ``exc`` the refusal restated here."""

    def on_control(self, src: int, msg: Control) -> None:
        """A control message for this group (a state query, a resync proposal)."""


class LateMessageError(CollectiveMismatchError):
    """A collective's data arrived after the operation had completed on the receiving rank."""


class Transport(ABC):
    """Moves messages between the ranks of one job. Algorithms see only this interface."""

    rank: int
    world_size: int
    mailbox: Mailbox

    def __init__(
        self,
        rank: int,
        world_size: int,
        loop: asyncio.AbstractEventLoop,
        settings: Settings | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.loop = loop
        # The job's settings (read from the environment here when none are given).
        self.settings = Settings.read() if settings is None else settings
        self.mailbox = Mailbox(rank, loop, self.settings.unexpected_cap, on_mismatch=self._report_mismatch)
        self.mailbox.on_late = self._late_message
        # The groups of which this rank is a member, by group id (``attach``).
        self._members: dict[int, Member] = {}
        self.dead_peers: dict[int, DistNetworkError] = {}
        # The first peer lost without a goodbye: later departures (often its consequence:
        # ranks that failed because of it and left) name it too.
        self.first_loss: DistNetworkError | None = None
        self.closed = False
        # How this rank leaves (said in the goodbye): set before closing when it is not a plain
        # destroy_process_group (the end of the program, an uncaught exception).
        self.goodbye: Goodbye | None = None
        # Control messages of groups not created here yet (a peer's resync right after
        # init_process_group or new_group can overtake this rank's own creation of the group),
        # handed over when the group registers; and the ids of groups that are gone.
        self._control_early: dict[int, list[tuple[int, Control]]] = {}
        self._control_gone: set[int] = set()
        # Every global rank's host id, and whether it reaches every other rank of its host
        # through shared memory: equal on every rank (the mesh agrees on them at rendezvous;
        # None: unknown). Host-aware collectives choose their algorithms from them.
        self.host_keys: tuple[str, ...] | None = None
        self.shm_local: tuple[bool, ...] | None = None
        # AIODIST_HOST_ALGOS as the job agreed on it ("auto", "flat", "direct").
        self.host_algos = "auto"
        # Groups that torch created on the backend "aiodist" over this transport, by torch's
        # name for them (so that aiodist.sync, given torch's group, finds aiodist's).
        self.torch_groups: dict[str, Any] = {}

    # -- the data path -----------------------------------------------------------------
    @abstractmethod
    def send(
        self, dst: int, key: Key, payload: memoryview, fp: Fingerprint | None = None
    ) -> asyncio.Future[None]:
        """Queue ``payload`` for ``dst`` now (call order is wire order); await for buffer reuse."""

    def recv(
        self, src: int | None, key: Key, buf: memoryview, fp: Fingerprint | None = None
    ) -> asyncio.Future[int]:
        """Post a receive into ``buf``; the future resolves to the sender's rank."""
        return self.mailbox.post(src, key, buf, fp)

    def cancel_recv(self, fut: asyncio.Future[int]) -> None:
        """Withdraw the receive ``fut`` (its timeout, a cancellation): nothing is written into
        its buffer from now on; a message that was arriving for it goes to the next receive."""
        self.mailbox.cancel(fut)

    def cancel_send(self, dst: int, fut: asyncio.Future[None]) -> bool:
        """Withdraw the pending send ``fut`` to ``dst`` (its timeout, a cancellation).

        Returns:
            True: nothing of the message will be delivered (the caller fails ``fut``); False:
            too late, the message is delivered or is the socket's, whole (``fut`` completes).
        """
        return False

    def abandon(self, key: Key) -> None:
        """The operation ``key`` failed or timed out here: its messages still arriving are
        dropped, and its own still pending sends withdrawn (nothing of them is delivered)."""
        self.mailbox.abandon(key)

    # -- the groups ---------------------------------------------------------------------
    def attach(self, gid: int, member: Member) -> None:
        """Tell ``member`` (group ``gid``, of which this rank is a member) what concerns it, from
        the control messages that came before it on."""
        self._members[gid] = member
        self.mailbox.origin_books[gid] = member.origins
        for src, msg in self._control_early.pop(gid, ()):
            if self._members.get(gid) is member and not self.closed:
                member.on_control(src, msg)

    def detach(self, gid: int, member: Member) -> None:
        """``member`` is gone: its group's control messages are dropped from now on."""
        if self._members.get(gid) is not member:
            return
        del self._members[gid]
        if self.mailbox.origin_books.get(gid) is member.origins:
            del self.mailbox.origin_books[gid]
        self._control_gone.add(gid)
        self._control_early.pop(gid, None)

    def _control_received(self, src: int, msg: Control) -> None:
        """A control message of a group arrived from ``src``: its group answers it (or will,
        once it exists here: data messages wait for their receives the same way)."""
        gid = getattr(msg, "gid", None)
        if not isinstance(gid, int) or self.closed:
            return
        member = self._members.get(gid)
        if member is not None:
            member.on_control(src, msg)
        elif gid not in self._control_gone:
            early = self._control_early.get(gid)
            if early is None:
                if len(self._control_early) >= _EARLY_GROUPS_KEPT:
                    return  # (a peer cannot run that far ahead in a well-formed program)
                early = self._control_early[gid] = []
            if len(early) < _EARLY_CONTROL_KEPT:
                early.append((src, msg))

    @abstractmethod
    def send_control(self, dst: int, msg: Control) -> None:
        """Send a control message to ``dst`` (best effort: nothing when it is gone)."""

    def _with_first_loss(self, exc: DistNetworkError) -> DistNetworkError:
        first = self.first_loss
        if first is None or first is exc:
            return exc
        err = DistNetworkError(f"{exc} (after an earlier loss: {first})")
        err.__cause__ = exc.__cause__
        return err

    def _peer_lost(self, peer: int, exc: DistNetworkError) -> None:
        if peer in self.dead_peers:
            return
        exc = self._with_first_loss(exc)
        if self.first_loss is None:
            self.first_loss = exc
        self.dead_peers[peer] = exc
        for member in list(self._members.values()):
            member.on_peer_gone(peer, exc)
        self.mailbox.fail_peer(peer, exc)
        for member in list(self._members.values()):
            member.on_peer_lost(peer, exc)

    def _peer_left(self, peer: int, exc: DistNetworkError) -> None:
        """``peer`` left in an orderly way: operations that still need it fail; groups go on."""
        if peer in self.dead_peers:
            return
        exc = self._with_first_loss(exc)
        self.dead_peers[peer] = exc
        for member in list(self._members.values()):
            member.on_peer_gone(peer, exc)
        self.mailbox.fail_peer(peer, exc)

    def finish_collective(self, key: Key) -> tuple[int, Fingerprint | None] | None:
        """The collective ``key`` completed on this rank: its later data is late.

        Returns:
            None, or (sender, fingerprint) of a message still held for it, which no step of
            the operation received: the ranks disagreed about it. The sender has then been
            told, and every group using the key has been failed (``LateMessageError``).
        """
        late = self.mailbox.finish(key)
        if late is not None:
            self._late_message(late[0], key, late[1])
        return late

    def _late_message(self, src: int, key: Key, fp: Fingerprint | None) -> None:
        """``src`` sent data for a collective that already completed here: the ranks disagree
        about that operation (e.g. both believe they are its root). Whoever still runs it fails;
        every group using the key learns it cannot be trusted."""
        exc = LateMessageError(
            f"rank {src} sent {describe_fingerprint(fp)} after rank {self.rank} had completed that "
            "operation: the ranks disagree about it (different roots, or different collectives)"
        )
        self._send_mismatch(src, key, fp, None)
        self._key_failed(key, exc)

    def _key_failed(self, key: Key, exc: BaseException) -> None:
        self.mailbox.fail_key(key, exc)
        member = self._members.get(key[0])
        if member is not None:
            member.on_key_failed(key, exc)

    def _report_mismatch(
        self, src: int, key: Key, sent: Fingerprint | None, want: Fingerprint | None
    ) -> None:
        """Our receive disagreed with what ``src`` sent: fail our op and tell the sender.

        A point-to-point message stands alone: the receive that did not match fails (the
        mailbox did that) and the tag stays usable for the next message; the sender is told,
        so that its send fails too (``_mismatch_reported``).
        """
        if key[1] == P2P:
            self._send_mismatch(src, key, sent, want)
            return
        if key[1] != COLL:
            return
        exc = CollectiveMismatchError(describe_disagreement(self.rank, want, src, sent))
        self.loop.call_soon(self._key_failed, key, exc)
        self._send_mismatch(src, key, sent, want)

    @abstractmethod
    def _send_mismatch(self, dst: int, key: Key, sent: Fingerprint | None, want: Fingerprint | None) -> None:
        """Tell ``dst`` that its message for ``key`` met a different operation here."""

    @abstractmethod
    def send_abort(self, dst: int, key: Key, reason: str, kind: str = "network") -> None:
        """Tell ``dst`` that this rank abandoned the operation ``key`` (best effort).

        ``kind`` says why, so that ``dst`` raises the same class of error: ``"network"``
        (a lost peer: ``DistNetworkError``), ``"mismatch"`` (``CollectiveMismatchError``)
        or ``"error"`` (anything else: ``DistError``).
        """

    def _abort_reported(self, src: int, key: Key, reason: str, kind: str = "network") -> None:
        """``src`` abandoned the operation ``key``: fail ours, it will not get its data."""
        self._key_failed(key, ABORT_KINDS.get(kind, DistError)(reason))

    def _mismatch_reported(
        self, src: int, key: Key, ours: Fingerprint | None, theirs: Fingerprint | None
    ) -> None:
        """``src`` told us our message for ``key`` met its different operation."""
        if key[1] == P2P:
            refused = CollectiveMismatchError(
                f"rank {src} expected {describe_fingerprint(theirs)} but rank {self.rank} sent "
                f"{describe_fingerprint(ours)} (tag {key[2]})"
            )
            member = self._members.get(key[0])
            if member is not None:
                member.on_send_refused(src, key, ours, refused)
            return
        if key[1] != COLL:
            return  # (see _report_mismatch)
        if theirs is None:
            exc: CollectiveMismatchError = CollectiveMismatchError(
                f"rank {src} received {describe_fingerprint(ours)} from rank {self.rank} after it had "
                "completed that operation: the ranks disagree about it"
            )
        else:
            exc = CollectiveMismatchError(describe_disagreement(src, theirs, self.rank, ours))
        self._key_failed(key, exc)

    def stall_note(self) -> str:
        """Why data may be stuck here (e.g. reading paused at the unexpected cap), for timeout
        messages; empty when nothing is."""
        return ""

    def _check_peer(self, peer: int) -> None:
        """Raise the recorded error if ``peer`` is known to be gone."""
        if peer in self.dead_peers:
            raise self.dead_peers[peer]

    # -- lifetime ----------------------------------------------------------------------
    @abstractmethod
    async def aclose(self) -> None:
        """Flush what was queued (bounded) and close every connection."""

    @abstractmethod
    def abort(self) -> None:
        """Close every connection at once."""

    # -- where the peers are (for host-aware algorithms) ---------------------------------
    def local_peers(self) -> list[int]:
        """Peers whose data messages travel through shared memory with this rank (both ways)."""
        return []
