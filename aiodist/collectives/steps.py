"""Collectives written as steps: a generator yields the transport futures of each step, and the
next step runs when they have all completed.

Why: a collective run as a task costs a ``Task`` (its context, its name, one loop turn before
its first line) and a chain of coroutines per operation, several times what a small message
costs on the wire. Written as a generator, the same algorithm is advanced by the arrivals
themselves (``Stepper``): the callback of the step's last future runs the next step, with no
task and no coroutine in between. The algorithms stay readable top to bottom, and ``drive``
awaits the same steps from a coroutine where an algorithm is one phase of a larger one.

A planner (``aiodist.backends.native.algorithm`` and the dispatchers it calls) returns a
``Plan``: the chosen algorithm's steps where it is written as steps (the small and one-host
forms), else its coroutine (the large, pipelined forms keep a task). ``run`` awaits either.

A step yields a tuple of futures (a send's completion, a receive's, a reduction's in a worker
thread); the step's failure is the first failure among them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Generator
from types import GeneratorType
from typing import Any, cast

from aiodist.collectives._common import wait_all

__all__ = ["Plan", "Steps", "Stepper", "drive", "is_steps", "no_steps", "run"]

#: An algorithm's steps: each item, the futures the next step waits for.
Steps = Generator[tuple["asyncio.Future[Any]", ...], None, None]
#: The algorithm a planner chose: its steps, or (where it is not written as steps) its coroutine.
Plan = Steps | Coroutine[Any, Any, None]


def no_steps() -> Steps:
    """The plan of an operation with nothing to exchange (a group of one)."""
    yield from ()


async def drive(steps: Steps) -> None:
    """Run ``steps`` from a coroutine: await each step's futures in order."""
    for waits in steps:
        await wait_all(waits)


async def run(plan: Plan) -> None:
    """Run ``plan`` from a coroutine (a phase of a larger algorithm, a gated operation)."""
    if isinstance(plan, GeneratorType):
        await drive(plan)
    else:
        await cast("Coroutine[Any, Any, None]", plan)  # (GeneratorType does not narrow a Plan)


def is_steps(plan: Plan) -> bool:
    """Whether ``plan`` is steps (else a coroutine). A plain type check: an ``isinstance`` of
    ``collections.abc.Generator`` costs several calls, on every operation."""
    return type(plan) is GeneratorType


class Stepper:
    """Runs ``steps`` as the arrivals allow, then calls ``ended(None)``, or ``ended(exc)`` with the
    first failure (of a step's future, or raised by a step). ``stop()``: the operation failed
    elsewhere (its timeout, a member's notice); no step runs after it and ``ended`` is not called.
    """

    __slots__ = ("_ended", "_left", "_over", "_steps")

    def __init__(self, steps: Steps, ended: Callable[[BaseException | None], None]) -> None:
        self._steps = steps
        self._ended = ended
        self._left = 0  # futures of the current step still pending
        self._over = False

    @property
    def over(self) -> bool:
        """It has ended (or been stopped): no step runs any more."""
        return self._over

    def stop(self) -> None:
        if not self._over:
            self._over = True
            self._steps.close()

    def start(self) -> None:
        """Take the steps that can be taken now (the rest follow their futures)."""
        self._advance()

    def resume(self, waits: tuple[asyncio.Future[Any], ...]) -> None:
        """Go on from the step whose futures are ``waits``, taken elsewhere (a blocking
        caller's thread ran the steps up to there: ``aiodist.collectives.here``)."""
        self._advance(waits)

    def _advance(self, waits: tuple[asyncio.Future[Any], ...] | None = None) -> None:
        while True:
            if waits is None:
                try:
                    waits = next(self._steps)
                except StopIteration:
                    self._end(None)
                    return
                except BaseException as raised:  # (a step raised: the operation's error)
                    self._end(raised)
                    return
            left = 0
            for w in waits:
                if not w.done():
                    left += 1
                    w.add_done_callback(self._arrived)
                elif w.cancelled():
                    self._end(asyncio.CancelledError())
                    return
                elif (failed := w.exception()) is not None:
                    self._end(failed)
                    return
            if left:
                self._left = left
                return
            waits = None

    def _arrived(self, fut: asyncio.Future[Any]) -> None:
        # (exception() marks a failure retrieved: one after the end is not logged as lost)
        exc = asyncio.CancelledError() if fut.cancelled() else fut.exception()
        if self._over:
            return
        if exc is not None:
            self._end(exc)
            return
        self._left -= 1
        if not self._left:
            self._advance()

    def _end(self, exc: BaseException | None) -> None:
        if self._over:
            return
        self._over = True
        self._steps.close()
        self._ended(exc)
