"""Busy polling: keep an event loop polling for a moment while operations wait, instead of
letting it sleep in ``epoll_wait``.

Why: a process that sleeps must be woken when its data arrives, and on a virtual machine
that wake-up (an inter-processor interrupt through the hypervisor) costs far more than the
message. Measured on this project's 2-vCPU guest, uvloop ping-pong of 8 B between two
processes: 12 µs one way when each side answers at once, 31 µs when each side first spends
10 µs of Python, 62-72 µs with 20 µs: every microsecond of work before the answer costs
two more in wake-up, because the peer has gone to sleep meanwhile. MPI and NCCL poll for the
same reason (Linux has it too: ``SO_BUSY_POLL``).

How: a callback re-schedules itself with ``call_soon``, which makes the loop poll with a
zero timeout, until nothing has happened for a budget (``AIODIST_BUSY_POLL_US``
microseconds, 200 by default): an operation starting or ending, or a source reporting that
something moved (a record, a read finished, a completion), starts the budget again. The
budget bounds the CPU spent on a peer that is slow: after it the loop sleeps as usual.
On the async face the loop keeps polling for one budget after the last operation ends: an
async program's operations come one after another, and the next one's messages then need
no doorbell (measured: without it about one message in six of a stream of 1 MiB sendrecvs
rang one, at about 20 µs of the sender's time each).

When: only where the host has a core for each of its ranks, and its machine one for each of
the ranks of all its hosts (containers or network namespaces of one machine share its cores;
``aiodist.runtime.host``): polling on oversubscribed cores takes the core another rank needs. The sync face's loop thread polls only
while a caller is blocked on it, never while the caller's thread computes (the GIL is shared).

Sources: a transport with shared memory registers a ``PollSource``; every turn of a polling
loop looks at it (its rings), and it is told when polling starts and stops (so that writers
may skip the doorbells of a reader that polls anyway).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from typing import Protocol

from aiodist.runtime import host as _host

__all__ = ["BusyPoll", "DEFAULT_BUDGET_US", "PollSource", "for_loop"]

DEFAULT_BUDGET_US = 200.0


# AIODIST_BUSY_POLL_US as the job's settings say (``configure``); None: decided by the cores.
_configured_us: float | None = None


def configure(us: float | None) -> None:
    """Take ``AIODIST_BUSY_POLL_US`` from the job's settings (None: unset)."""
    global _configured_us
    _configured_us = us


def budget() -> float:
    """The poll budget in seconds: ``AIODIST_BUSY_POLL_US`` (0 disables polling), else 200 µs
    where every rank of the host has a core to itself, else none."""
    if _configured_us is None:
        return DEFAULT_BUDGET_US * 1e-6 if _host.has_core_per_rank() else 0.0
    return _configured_us * 1e-6


class PollSource(Protocol):
    """Something a polling loop looks at on every turn (shared-memory rings)."""

    def poll(self) -> bool:
        """Look once; True if something moved since the last look (the budget starts again)."""
        ...

    def set_polling(self, polling: bool) -> None: ...


class BusyPoll:
    """The busy poller of one event loop.

    ``hold()`` when something starts waiting for the network, ``release()`` when it ends.
    ``for_ops``: whether a group's operations hold it (the async face), or only blocked
    callers of the sync face do (the loop thread, whose caller may be computing).
    """

    __slots__ = ("__weakref__", "_handle", "_sources", "_until", "budget", "for_ops", "loop", "waiting")

    def __init__(self, loop: asyncio.AbstractEventLoop, budget: float, *, for_ops: bool = True) -> None:
        self.loop = loop
        self.budget = budget
        self.for_ops = for_ops
        self.waiting = 0
        self._until = 0.0
        self._handle: asyncio.Handle | None = None
        self._sources: list[PollSource] = []

    def reconsider(self) -> None:
        """Take the budget again from what is known now (``aiodist.runtime.host`` learns at
        rendezvous how many ranks share the machine's cores); an explicit setting stands."""
        self.budget = budget()

    def add_source(self, source: PollSource) -> None:
        """Look at ``source`` on every turn while polling (see the module docstring)."""
        self._sources.append(source)
        if self._handle is not None:
            source.set_polling(True)

    def remove_source(self, source: PollSource) -> None:
        if source in self._sources:
            self._sources.remove(source)

    def hold(self) -> None:
        """Something started waiting: poll for up to the budget from now."""
        self.waiting += 1
        if self.budget <= 0.0:
            return
        self._until = time.monotonic() + self.budget
        if self._handle is None:
            self._handle = self.loop.call_soon(self._poll)
            for source in self._sources:
                source.set_polling(True)

    def release(self) -> None:
        """Something stopped waiting; on the async face the loop polls a budget more (the next
        operation usually starts sooner)."""
        self.waiting -= 1
        if self.for_ops and self._handle is not None:
            self._until = max(self._until, time.monotonic() + self.budget)

    def _poll(self) -> None:
        now = time.monotonic()
        for source in self._sources:
            if source.poll():
                self._until = now + self.budget
        if (self.waiting > 0 or self.for_ops) and now < self._until:
            self._handle = self.loop.call_soon(self._poll)
        else:
            self._handle = None
            for source in self._sources:
                source.set_polling(False)


_pollers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, BusyPoll] = weakref.WeakKeyDictionary()


def for_loop(loop: asyncio.AbstractEventLoop, *, for_ops: bool = True) -> BusyPoll:
    """The busy poller of ``loop``, created on first use (``for_ops`` counts only then: the
    loop thread of the sync face creates its poller before anything else touches its loop)."""
    poller = _pollers.get(loop)
    if poller is None:
        poller = _pollers[loop] = BusyPoll(loop, budget(), for_ops=for_ops)
    return poller
