"""A blocking collective run on its caller's thread, for as long as its steps complete there.

The blocking face starts every operation on the runtime's loop thread and sleeps until the
loop wakes it: two thread switches, which cost more than a small collective's messages. With
the compiled engine, a blocking collective on a group whose members share this host runs its
steps (``aiodist.collectives.steps``) on the caller's own thread instead, through a
``HereContext``:

* a send writes its record into the peer's ring from this thread (``Transport.send_here``);
* a receive posts itself from this thread (``Transport.post_here``), and the step waits for
  it there, spinning with the GIL released for the poll budget (``Transport.wait_here``);
* after the last step the operation is marked finished here (``Transport.finish_here``).

The messages are the ones the loop's way sends, with the same keys and fingerprints, in the
same order, so the other members may run the operation either way. Whatever this thread
cannot do is handed to the loop's thread, which goes on from where the steps stand (``drive``
returns the ``Handoff``): a send or receive this thread may not make (a queue on the link, a
message held for another receive, a peer of another host) is made there first, in order, and
every call after it too; a receive not come within the budget, a failed step, data left over
at the end (the ranks disagree) go there as they are. The loop's thread then tracks the
operation as any other: its timeout, a lost member, the failure notices.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from aiodist.collectives.context import OpContext
from aiodist.collectives.steps import Steps
from aiodist.transport.base import Fingerprint, Key, Transport
from aiodist.work import follow

__all__ = ["SMALL_BYTES", "SMALL_RANKS", "Handoff", "HereContext", "HereState", "drive"]

#: The calls run on a caller's thread: groups of at most SMALL_RANKS members, tensors of at most
#: SMALL_BYTES together. Larger ones take the loop thread's way from the start: their messages
#: take longer than the hop, and measured with torch tensors (2 ranks, 2 vCPUs), all_reduce and
#: broadcast of 1 and 16 MiB ran up to 2x slower on the caller's thread than the loop's, which
#: overlaps their segments; 64 KiB ran 1.2-2x faster there.
SMALL_BYTES = 64 * 1024
SMALL_RANKS = 8

#: A call deferred to the loop's thread: (a send?, global rank, buffer, the future given out).
Deferred = tuple[bool, int, memoryview, "asyncio.Future[Any]"]


class HereState:
    """What the contexts of one operation run on a caller's thread share (its phases' too)."""

    __slots__ = ("budget", "deferred", "on_loop", "posted")

    def __init__(self, budget: float) -> None:
        self.budget = budget  # seconds a step polls here for a receive (then it sleeps a while)
        self.on_loop = False  # handed over: every call from now on is the loop's own
        # The calls this thread could not make, for the loop's thread to make first, in order
        # (None: none yet; from the first one on, every call is deferred, to keep the order).
        self.deferred: list[Deferred] | None = None
        self.posted: dict[asyncio.Future[int], int] = {}  # receives posted here: their sender


class HereContext(OpContext):
    """An ``OpContext`` whose sends and receives are made from the caller's thread."""

    __slots__ = ("here",)

    def __init__(
        self,
        transport: Transport,
        ranks: Sequence[int],
        rank: int,
        key: Key,
        fp: Fingerprint | None,
        here: HereState,
    ) -> None:
        super().__init__(transport, ranks, rank, key, fp)
        self.here = here

    def send(self, peer: int, buf: memoryview) -> asyncio.Future[None]:
        here, dst = self.here, self.ranks[peer]
        if here.on_loop:
            return self.transport.send(dst, self.key, buf, self.fp)
        if (
            here.deferred is None
            and (sent := self.transport.send_here(dst, self.key, buf, self.fp)) is not None
        ):
            return sent
        return self._defer(True, dst, buf)

    def recv(self, peer: int, buf: memoryview) -> asyncio.Future[int]:
        here, src = self.here, self.ranks[peer]
        if here.on_loop:
            return self.transport.recv(src, self.key, buf, self.fp)
        if here.deferred is None:
            fut = self.transport.post_here(src, self.key, buf, self.fp)
            if fut is not None:
                if not fut.done():
                    here.posted[fut] = src
                return fut
        return self._defer(False, src, buf)

    def _defer(self, send: bool, rank: int, buf: memoryview) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = self.loop.create_future()
        here = self.here
        if here.deferred is None:
            here.deferred = []
        here.deferred.append((send, rank, buf, fut))
        return fut

    def among(self, ranks: Sequence[int], rank: int) -> OpContext:
        return HereContext(self.transport, ranks, rank, self.key, self.fp, self.here)

    def make_deferred(self) -> None:
        """On the loop's thread, taking over: from now on every call is the loop's own, and the
        calls this thread deferred are made first, in order, each completing what it gave out."""
        here = self.here
        here.on_loop = True
        for send, rank, buf, given in here.deferred or ():
            try:
                made: asyncio.Future[Any] = (
                    self.transport.send(rank, self.key, buf, self.fp)
                    if send
                    else self.transport.recv(rank, self.key, buf, self.fp)
                )
            except Exception as exc:  # (a lost peer: the step's failure, as where a step raises;
                given.set_exception(exc)  # the calls after it are not made, as they would not be)
                break
            follow(given, made)
        here.deferred = None


class Handoff:
    """Where the steps stand when the loop's thread takes them over: the futures of the step
    they wait for (``()``: none; the steps go on from the next), or the error a step raised."""

    __slots__ = ("error", "waits")

    def __init__(
        self, waits: tuple[asyncio.Future[Any], ...] = (), error: BaseException | None = None
    ) -> None:
        self.waits = waits
        self.error = error


def drive(ctx: HereContext, steps: Steps) -> Handoff | None:
    """Run ``steps`` on this thread while each step completes here, and finish the operation:
    None once it has ended well; else where the loop's thread must take over."""
    here, transport, key = ctx.here, ctx.transport, ctx.key
    try:
        for waits in steps:
            if here.deferred is not None:
                return Handoff(waits)
            for w in waits:
                if not w.done():
                    src = here.posted.get(w)
                    if src is None or not transport.wait_here(src, key, w, here.budget):
                        return Handoff(waits)
                if w.cancelled() or w.exception() is not None:
                    return Handoff(waits)  # (the loop's thread says what failed, and tells)
    except BaseException as exc:  # (a step raised, or this thread was interrupted: the
        # operation's error, raised the loop's way, which abandons it and tells the others)
        return Handoff(error=exc)
    # The end: data still held for the operation means the ranks disagreed, which the loop's
    # thread reports (the steps are over: it goes straight to their end).
    return None if transport.finish_here(key) else Handoff()
