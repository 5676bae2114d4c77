"""The transport interface that every algorithm is written against.

A transport moves *messages* between global ranks. A message is addressed by a ``Key``
``(group_id, channel, n)``: collectives use ``(gid, COLL, seq)``, point-to-point uses
``(gid, P2P, tag)``. Messages from one source with one key are matched in the order they
were sent (non-overtaking, as MPI); different keys never wait on each other, so any number
of operations can be in flight at once.

A receive is *posted* with the buffer its payload must land in. The transport's mailbox
(``aiodist.transport.matching``) matches arrivals against posted receives (a TCP payload is
then read straight into that buffer); a message that arrives before its receive is posted is
held in a bounded unexpected store. Every message may carry its operation's fingerprint; a
receive posted with a fingerprint only accepts a message with an equal one, and a
disagreement fails the receive with a ``CollectiveMismatchError`` naming both sides (and
tells the sender, through ``on_mismatch``: a collective fails there too; a refused
point-to-point message is handed to the sender's groups, ``add_send_refused_listener``).
"""

from __future__ import annotations

import asyncio
import sys
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Protocol

from aiodist.errors import CollectiveMismatchError, DistError, DistNetworkError, GroupOutOfStepError
from aiodist.runtime.origin import OriginBook
from aiodist.settings import Settings
from aiodist.transport.matching import (
    COLL,
    CTRL,
    DISCARD,
    P2P,
    Matcher,
    PendingRecv,
    Receive,
    describe_disagreement,
    describe_fingerprint,
    new_mailbox,
)
from aiodist.wire.control import Control, Goodbye
from aiodist.wire.fingerprint import Fingerprint
from aiodist.wire.messages import Key

__all__ = [
    "COLL",
    "CTRL",
    "P2P",
    "Fingerprint",
    "DISCARD",
    "Key",
    "Matcher",
    "Member",
    "PendingRecv",
    "Receive",
    "Transport",
    "describe_disagreement",
    "describe_fingerprint",
    "LateMessageError",
]

# Control messages kept for groups not created here yet: groups, and messages per group (a
# resync sends one proposal per member and retry; a state query one per timeout).
_EARLY_GROUPS_KEPT = 64
_EARLY_CONTROL_KEPT = 1024


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
    mailbox: Matcher

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
        self.mailbox = new_mailbox(
            rank, loop, self.settings.unexpected_cap, on_mismatch=self._report_mismatch
        )
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

    # A blocking operation done on its caller's thread, without the hop to the loop's (from a
    # thread other than the loop's; see shm_here): where a transport can, for a small message
    # to or from a peer of this host. These are all that may be called from another thread.
    @property
    def serves_here(self) -> bool:
        """Whether the calls below may do anything here (else they always refuse)."""
        return False

    def send_here(
        self, dst: int, key: Key, payload: memoryview, fp: Fingerprint | None
    ) -> asyncio.Future[None] | None:
        """Send from this thread: the send's future, complete (the message is written); None
        where nothing was sent and it must go the loop's way."""
        return None

    def recv_here(
        self, src: int, key: Key, buf: memoryview, fp: Fingerprint | None, budget: float
    ) -> asyncio.Future[int] | None:
        """Receive on this thread, waiting ``budget`` s at most (then a while asleep): the
        receive's future (done, or matched and still arriving: to be tracked on the loop's
        thread), or None where it must go the loop's way (nothing posted then)."""
        return None

    def post_here(
        self, src: int, key: Key, buf: memoryview, fp: Fingerprint | None
    ) -> asyncio.Future[int] | None:
        """Post a receive from this thread without waiting: its future (done where the message
        was here already), or None where nothing was posted and it must go the loop's way."""
        return None

    def wait_here(self, src: int, key: Key, fut: asyncio.Future[int], budget: float | None) -> bool:
        """Wait on this thread, ``budget`` s at most (then a while asleep; None: a look, no
        wait), for the receive ``post_here`` gave ``fut`` for: True once it is done; False
        where it is not (it stays posted: the loop's thread fills it when its message comes)."""
        return fut.done()

    def look_here(self, peers: Sequence[int], on: bool) -> None:
        """This thread starts (``on``) or stops looking for ``peers``' messages for a while
        (a collective's steps): their writers may skip waking the loop's thread meanwhile."""
        return None  # (a transport without shared memory has no one to tell)

    def finish_here(self, key: Key) -> bool:
        """``finish_collective`` from this thread where nothing is held for ``key``: True;
        False (nothing done) where the loop's thread must do it (it reports what is held)."""
        return False

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

    def _check_peer(self, peer: int, key: Key | None = None) -> None:
        """Raise the recorded error if ``peer`` is known to be gone; for the operation ``key``,
        a member's notice that it abandoned it first, where one came: it says why (a mismatch,
        say), and the member may well have left since, in consequence."""
        gone = self.dead_peers.get(peer)
        if gone is not None:
            raise (self.mailbox.failure(key) if key is not None else None) or gone

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
