"""``Work``: the one handle type every operation returns.

A Work wraps the future of one operation on the runtime's event loop. Awaiting it from that
loop shields the operation (cancelling the awaiting task stops the waiting, not the
operation); ``wait()`` blocks a thread other than the loop's; ``get_future()`` gives a
thread-safe ``concurrent.futures.Future``.

A Work dropped without anyone having taken its outcome is reported, as asyncio reports a
coroutine never awaited and a task whose exception was never retrieved: an operation that
succeeded with a ``RuntimeWarning`` ("... was never awaited"), one that failed by logging its
error on the "aiodist" logger (a lost error is worse than a lost result). One that is still
running when dropped is reported when it ends. Awaiting it to the end, ``get_future()``, and
``wait()``, ``result()``, ``exception()`` or ``is_success()`` once it has ended take the outcome;
``is_completed()``, those asked earlier, and a waiter cancelled mid-way take note of a success
only (a failure is still reported). With asyncio's debug
mode (``PYTHONASYNCIODEBUG=1``, ``asyncio.run(..., debug=True)``) the report shows where the
operation was started.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import functools
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Generator, Iterable
from typing import TYPE_CHECKING, Any

from aiodist.errors import DistError, DistTimeoutError
from aiodist.native import compiled_at_import
from aiodist.runtime.loop_thread import wait_future

__all__ = [
    "PythonWork",
    "Work",
    "copy_outcome",
    "discard",
    "follow",
    "future_of",
    "note_start",
    "take_outcome",
]

log = logging.getLogger("aiodist")

# How much of its outcome a Work's holder took (``Work._seen``): nothing, only the fact that it
# completed (``is_completed``), or the outcome itself (its result or its error).
_UNSEEN = 0
_LOOKED = 1
_TAKEN = 2


class _Waiting:
    """What a task awaiting a Work on the runtime's loop waits on: a future-like stand-in for
    the operation's future that cannot cancel it.

    The waiting task's wake-up is registered on the operation's future itself, so the task
    resumes in the loop iteration in which the operation completes (``asyncio.shield`` chains
    a second future, which costs one more iteration and two Python callbacks per call). When
    the task is cancelled, ``cancel`` takes the wake-up back off the operation's future and
    wakes the task with ``CancelledError``; the operation goes on.
    """

    __slots__ = ("_asyncio_future_blocking", "_context", "_loop", "_op", "_wakeup", "cancelled_msg")

    def __init__(self, op: asyncio.Future[Any], loop: asyncio.AbstractEventLoop) -> None:
        self._op = op
        self._loop = loop
        self._asyncio_future_blocking = True  # what Future.__await__ sets before yielding itself
        self._wakeup: Any = None
        self._context: Any = None
        self.cancelled_msg: tuple[Any, ...] | None = None

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def done(self) -> bool:
        return self.cancelled_msg is not None or self._op.done()

    def cancelled(self) -> bool:
        return self.cancelled_msg is not None

    def add_done_callback(self, fn: Any, *, context: Any = None) -> None:
        self._wakeup, self._context = fn, context
        self._op.add_done_callback(fn, context=context)

    def remove_done_callback(self, fn: Any) -> int:
        return self._op.remove_done_callback(fn)

    def cancel(self, msg: Any = None) -> bool:
        if self.cancelled_msg is not None or self._op.done():
            return False  # the wake-up is on its way; the task raises CancelledError then
        self._op.remove_done_callback(self._wakeup)
        self.cancelled_msg = () if msg is None else (msg,)
        self._loop.call_soon(self._wakeup, self, context=self._context)
        return True

    def result(self) -> Any:
        if self.cancelled_msg is not None:
            raise asyncio.CancelledError(*self.cancelled_msg)
        return self._op.result()

    def exception(self) -> BaseException | None:
        if self.cancelled_msg is not None:
            raise asyncio.CancelledError(*self.cancelled_msg)
        return self._op.exception()


class Work:
    """Handle of one started operation.

    Args:
        future: completes with the operation's result (None, or the source rank for recv).
        name: what the operation is, for error messages ("all_reduce #17 on rank 2").
    """

    __slots__ = ("_cf", "_future", "_loop", "_seen", "_started_at", "name")

    def __init__(self, future: asyncio.Future[Any], name: str) -> None:
        self._future = future
        self._loop = future.get_loop()
        self._cf: concurrent.futures.Future[Any] | None = None
        self._seen = _UNSEEN
        self.name = name
        # Where the caller started it, for the report of a Work dropped unseen: set by a face
        # that starts operations away from the caller's thread (the sync face, in asyncio's
        # debug mode); otherwise the stack asyncio records for the future in that mode says it.
        self._started_at: traceback.StackSummary | None = None

    def __del__(self) -> None:
        if self._seen != _TAKEN:
            _dropped(self._future, self.name, self._seen, self._loop, self._started_at)

    @classmethod
    def completed(cls, loop: asyncio.AbstractEventLoop, name: str, result: Any = None) -> Work:
        fut = loop.create_future()
        fut.set_result(result)
        return cls(fut, name)

    @classmethod
    def failed(cls, loop: asyncio.AbstractEventLoop, name: str, exc: BaseException) -> Work:
        fut = loop.create_future()
        fut.set_exception(exc)
        return cls(fut, name)

    def __repr__(self) -> str:
        state = "done" if self._future.done() else "pending"
        return f"<Work {self.name} {state}>"

    # -- asyncio -------------------------------------------------------------------------
    def __await__(self) -> Generator[Any, None, Any]:
        fut = self._future
        if not fut.done():
            # Awaited: a success is not reported even if the waiting is cancelled; a failure is,
            # unless the waiting ends with it (below).
            self._seen = _LOOKED
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is self._loop:
                # A cancelled waiter must not cancel the operation itself (what asyncio.shield
                # does, one loop iteration and two callbacks cheaper: see _Waiting).
                waiting = _Waiting(fut, loop)
                try:
                    yield waiting
                except BaseException:  # (the task throws the operation's error in here)
                    if waiting.cancelled_msg is None:
                        self._seen = _TAKEN
                    raise
                if waiting.cancelled_msg is not None:
                    raise asyncio.CancelledError(*waiting.cancelled_msg)
            else:
                yield from asyncio.wrap_future(self.get_future()).__await__()
        self._seen = _TAKEN
        return fut.result()

    # -- state ---------------------------------------------------------------------------
    def is_completed(self) -> bool:
        """True once the operation has finished, successfully or not."""
        if self._seen == _UNSEEN:
            self._seen = _LOOKED
        return self._future.done()

    def is_success(self) -> bool:
        """True once the operation has finished without error."""
        fut = self._future
        self._seen = _TAKEN if fut.done() else max(self._seen, _LOOKED)
        return fut.done() and not fut.cancelled() and fut.exception() is None

    def exception(self) -> BaseException | None:
        """The operation's error, or None (also None while it runs)."""
        fut = self._future
        if not fut.done():
            self._seen = max(self._seen, _LOOKED)
            return None
        self._seen = _TAKEN
        if fut.cancelled():
            return DistError(f"{self.name} was cancelled")
        return fut.exception()

    def result(self) -> Any:
        """The operation's result; raises its error. Only valid once completed."""
        if not self._future.done():
            self._seen = max(self._seen, _LOOKED)
            raise DistError(f"{self.name} has not completed yet")
        self._seen = _TAKEN
        return self._future.result()

    # -- threads -------------------------------------------------------------------------
    def wait(self, timeout: float | datetime.timedelta | None = None) -> bool:
        """Block this thread until the operation completes; raise its error if it failed.

        Args:
            timeout: seconds (or torch's ``timedelta``; ``timedelta(0)`` means no limit) to wait
                at most. When it runs out, ``DistTimeoutError`` is raised and the operation keeps
                running.
        Returns:
            True, as torch's ``Work.wait``.
        Raises:
            DistError: from a thread running the runtime loop (it would deadlock).
        """
        if isinstance(timeout, datetime.timedelta):  # torch's form; timedelta(0) means no limit
            timeout = timeout.total_seconds() or None
        if self._future.done():
            self.result()
            return True
        self._seen = max(self._seen, _LOOKED)  # (taken once the wait ends with the outcome)
        if self._on_loop_thread():
            raise DistError(
                f"Work.wait() for {self.name} called on the runtime's loop thread; use 'await work'"
            )
        try:
            done, _ = wait_future(self._loop, self._future, timeout)
        except asyncio.CancelledError:
            self._seen = _TAKEN
            raise DistError(f"{self.name} was cancelled") from None
        except BaseException:
            if self._future.done():  # the operation's error, raised to the caller
                self._seen = _TAKEN
            raise
        if not done:
            raise DistTimeoutError(f"{self.name} did not complete within {timeout} s (it is still running)")
        self._seen = _TAKEN
        return True

    def get_future(self) -> concurrent.futures.Future[Any]:
        """A thread-safe future completing with the operation."""
        self._seen = _TAKEN
        if self._cf is None:
            cf: concurrent.futures.Future[Any] = concurrent.futures.Future()
            self._cf = cf
            if self._future.done():
                self._copy_to_cf(self._future)
            elif self._on_loop_thread():
                self._future.add_done_callback(self._copy_to_cf)
            else:
                self._loop.call_soon_threadsafe(self._future.add_done_callback, self._copy_to_cf)
        return self._cf

    def _copy_to_cf(self, fut: asyncio.Future[Any]) -> None:
        cf = self._cf
        assert cf is not None
        if cf.done():
            return
        if fut.cancelled():
            cf.set_exception(DistError(f"{self.name} was cancelled"))
        elif fut.exception() is not None:
            cf.set_exception(fut.exception())
        else:
            cf.set_result(fut.result())

    def _on_loop_thread(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    # torch compatibility
    def source_rank(self) -> int:
        """The sender of a completed ``recv``/``irecv`` (torch's ``Work.source_rank``)."""
        return int(self.result())

    # torch's suite and some user code call the private spelling; it is the same method.
    _source_rank = source_rank

    def synchronize(self) -> None:
        """No-op for host tensors (torch uses it for CUDA streams)."""


# -- Works dropped unseen ----------------------------------------------------------------------


# -- the runtime's interface to a Work (the faces, DDP and the torch adapter use these, never
#    its private fields) ---------------------------------------------------------------------


def future_of(work: Work) -> asyncio.Future[Any]:
    """The operation's future, on its loop, to look at (done yet? a callback when it is)
    without taking its outcome: the Work still reports an error nobody saw."""
    return work._future


def take_outcome(work: Work) -> asyncio.Future[Any]:
    """The operation's future, for runtime code that takes over its outcome (the sync face's
    blocking calls, a Work that follows another): this Work is not reported."""
    work._seen = _TAKEN
    return work._future


def copy_outcome(to: asyncio.Future[Any], src: asyncio.Future[Any]) -> None:
    """Give ``to`` the outcome of ``src`` (done), unless ``to`` is done already."""
    if to.done():
        return
    if src.cancelled():
        to.cancel()
    elif (exc := src.exception()) is not None:
        to.set_exception(exc)
    else:
        to.set_result(src.result())


def follow(to: asyncio.Future[Any], src: asyncio.Future[Any]) -> None:
    """``to`` takes ``src``'s outcome, now or when it has one: where a future handed out
    follows one made later (on the loop's thread, for a caller's; a send made before its peer
    was connected)."""
    if src.done():
        copy_outcome(to, src)
    else:
        src.add_done_callback(functools.partial(copy_outcome, to))


def discard(work: Work) -> None:
    """Runtime code drops the operation's outcome on purpose (its caller holds an earlier error
    that explains it, e.g. the first of several bucket all_reduces that failed): neither aiodist
    nor asyncio reports it."""
    work._seen = _TAKEN
    if work._future.done():
        _retrieve(work._future)
    else:
        work._future.add_done_callback(_retrieve)


def note_start(work: Work, stack: traceback.StackSummary) -> None:
    """Where the caller started ``work``, for the report of a Work dropped unseen (a face that
    starts operations away from the caller's thread says it; see ``Work.__init__``)."""
    work._started_at = stack


def _dropped(
    fut: asyncio.Future[Any],
    name: str,
    seen: int,
    loop: asyncio.AbstractEventLoop,
    started_at: traceback.StackSummary | None,
) -> None:
    """A Work whose outcome nobody took was dropped: report its operation's outcome now, or
    when it ends (called from ``Work.__del__``: never raises)."""
    try:
        if fut.done():
            _report(name, seen, started_at, fut)
            return
        later = functools.partial(_report, name, seen, started_at)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            fut.add_done_callback(later)
        elif not loop.is_closed():
            loop.call_soon_threadsafe(fut.add_done_callback, later)
    except Exception:  # (e.g. at interpreter exit, with half the world torn down)
        pass


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # (marks it retrieved)


def _report(
    name: str, seen: int, started_at: traceback.StackSummary | None, fut: asyncio.Future[Any]
) -> None:
    if fut.cancelled():
        return
    exc = fut.exception()  # (also keeps asyncio from logging it a second time, less clearly)
    if exc is None and seen != _UNSEEN:
        return
    caller = _callers_frames(started_at or getattr(fut, "_source_traceback", None) or ())
    where = (
        "\nIt was started at (most recent call last):\n" + "".join(traceback.format_list(caller)).rstrip()
        if caller
        else " (asyncio's debug mode, PYTHONASYNCIODEBUG=1, shows where it was started)"
    )
    if exc is not None:
        log.error(
            "aiodist: the error of %s was never retrieved: its Work was dropped without being "
            "awaited or waited for%s",
            name,
            where,
            exc_info=(type(exc), exc, exc.__traceback__),
        )
        return
    message = (
        f"aiodist: {name} was never awaited: its Work was dropped without await, wait(), result() "
        f"or is_completed() (await it, or keep it and wait for it before using its data){where}"
    )
    if caller:  # attributed to the caller's line, as a warning raised there would be
        warnings.warn_explicit(message, RuntimeWarning, caller[-1].filename, caller[-1].lineno or 0)
    else:
        warnings.warn(message, RuntimeWarning, stacklevel=2)


# Frames of these packages are left out of "where it was started": the caller's are what say where.
_NOT_THE_CALLER = tuple(
    os.path.dirname(os.path.abspath(m.__file__ or "")) + os.sep
    for m in (asyncio, sys.modules[__package__ or "aiodist"])
)


def _callers_frames(stack: Iterable[traceback.FrameSummary]) -> list[traceback.FrameSummary]:
    """The last few of the caller's frames of the stack that started the operation (``started_at``,
    else the one asyncio records for its future in debug mode; none otherwise)."""
    frames = [f for f in stack if not os.path.abspath(f.filename).startswith(_NOT_THE_CALLER)]
    return frames[-6:]


# -- the engine's choice -------------------------------------------------------------------------
# The compiled twin of ``Work`` where it was built, chosen when this module loads
# (``aiodist.native.compiled_at_import``): every Work of the process is of one class. A bad or
# unmet ``AIODIST_NATIVE`` is not raised here (importing aiodist must work): ``init_process_group``
# raises it, when the transport asks for its compiled parts. ``PythonWork`` stays the reference
# and the fallback.
PythonWork = Work
_native = compiled_at_import("aiodist._work")
if _native is not None and not TYPE_CHECKING:
    _native.bind(_dropped, wait_future)
    Work = _native.Work
