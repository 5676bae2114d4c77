"""The thread hop from a user's thread to the runtime loop thread.

A blocking call starts its operation on the loop thread and waits for it; with
``async_op=True`` it returns the ``Work`` (whose ``wait()`` blocks the calling thread).
Operations are started by a plain callback and waited on with the thread's own lock
(``aiodist.runtime.loop_thread``): no Task and no ``concurrent.futures.Future`` on the hot path.
``isend``/``irecv`` do not wait even for the start (``start_p2p``): a pipeline of them costs
the caller no thread hop per message.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime
import functools
import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable, Coroutine, Generator
from typing import Any, TypeVar

import numpy as np

from aiodist import work as _work
from aiodist._tensors import NotContiguousError
from aiodist.backends.staged import on_caller_stream
from aiodist.collectives.here import SMALL_BYTES, SMALL_RANKS
from aiodist.errors import DistError
from aiodist.face.world import resolve_group
from aiodist.group import ProcessGroup
from aiodist.operations import operation_named
from aiodist.runtime import busy_poll as _busy_poll
from aiodist.runtime import origin as _origin
from aiodist.runtime.loop_thread import LoopThread, get_loop_thread, started_loop_thread
from aiodist.work import Work

__all__ = [
    "call",
    "collective_here",
    "irecv_here",
    "isend_here",
    "on_loop",
    "recv_here",
    "run",
    "send_here",
    "start_p2p",
]

T = TypeVar("T")


def call(fn: Callable[[], Work], async_op: bool) -> Any:
    """Start ``fn()`` (which returns a Work) on the loop; block for its result unless ``async_op``.

    Returns:
        The Work with ``async_op``; otherwise the operation's result (None, or the sender's
        rank for a receive).
    Raises:
        Whatever starting the operation raised (bad arguments), or the operation's error.
    """
    lt = get_loop_thread()
    fn = on_caller_stream(fn)  # torch's current CUDA stream is per thread: carry the caller's over
    if async_op:
        work = lt.call(fn)
        if lt.loop.get_debug():  # asyncio's debug mode: a Work dropped unseen says where it began
            _work.note_start(work, traceback.extract_stack(sys._getframe(1)))
        return work
    try:
        return lt.call_until_done(lambda: _work.take_outcome(fn()))
    except asyncio.CancelledError:
        raise DistError("the operation was cancelled") from None


def on_loop(fn: Callable[[], T]) -> T:
    """Run the plain function ``fn`` on the loop thread (where the runtime's objects live)."""
    return get_loop_thread().call(fn)


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine (init, new_group, destroy...) on the loop thread and block for its result."""
    return get_loop_thread().run(coro)


def start_p2p(
    fn: Callable[[Any], Work], what: str, tensor: Any, peer: int | None, group: Any, tag: int
) -> Work:
    """Start the send or receive ``fn(tensor)`` (``what``: "send"/"recv"); return its Work at once.

    The arguments are checked here, in the caller's thread, so a mistake raises at the call as
    in torch; the operation is then posted to the loop thread without waiting for it to start
    (a burst of 100 ``isend`` of 8 B cost a round trip to the loop thread each: 30-170 µs a
    message on 2 vCPUs), and given the numpy view the check made (converting a torch tensor
    costs 1.8 µs; a numpy array 0.3). Calls from one thread reach the loop in order, so
    messages between a pair keep their order. Tensors the backend does not use directly (staged
    CUDA tensors, torch engines) take the blocking start (``call``).
    """
    lt = get_loop_thread()
    g = resolve_group(group)
    if g.runs_on.direct(tensor) and not lt.in_loop_thread():
        arr = g.check_p2p(what, tensor, peer, tag)
        work = Work(lt.loop.create_future(), f"{what} (starting)")
        _starting.append(work)
        try:
            lt.loop.call_soon_threadsafe(_start_into, functools.partial(fn, arr), work)
        except BaseException:  # (the loop is closed: nothing will start it)
            _starting.remove(work)
            raise
        return work
    return call(lambda: fn(tensor), True)  # type: ignore[no-any-return]


def _start_into(fn: Callable[[], Work], work: Work) -> None:
    """On the loop: start ``fn()`` and let ``work`` follow the Work it returns."""
    out = _work.future_of(work)
    try:
        started = fn()
    except BaseException as exc:  # the group broke or went away since the caller checked
        out.set_exception(exc)
        return
    finally:
        _starting.remove(work)
    work.name = started.name
    _work.follow(out, _work.take_outcome(started))  # ``work`` reports its outcome to the caller


# The operations ``start_p2p`` handed to the loop that it has not started yet (a deque: its
# appends and removals are atomic under the GIL, from either thread). While there are any, a
# blocking send or receive may not overtake them on the caller's thread.
_starting: deque[Work] = deque()


def _here_thread() -> LoopThread | None:
    """The runtime's loop thread where this thread may run an operation itself: it is not that
    thread, and has handed it no operation that it has not started (which this one must not
    overtake); None otherwise."""
    lt = started_loop_thread()
    return None if lt is None or _starting or lt.in_loop_thread() else lt


def collective_here(name: str, group: Any, args: tuple[Any, ...], timeout: float | None) -> bool:
    """A blocking collective (the operation table's entry ``name``, with the async face's
    arguments) run on this thread where it can be (``ProcessGroup.collective`` with ``here``):
    True once done; False where nothing started and it goes the loop's way. Raises its error.

    ``args`` are the call's tensors (lists of them) first: each must be one the backend uses
    directly (staged CUDA tensors take the loop's way)."""
    lt = _here_thread()
    if lt is None or asyncio._get_running_loop() is not None:
        return False
    g = resolve_group(group)
    if g.size > SMALL_RANKS or not g.runs_here():
        return False
    direct = g.runs_on.direct
    nbytes = 0
    for a in args[: operation_named(name).tensors]:
        for t in a if isinstance(a, list | tuple) else (a,):
            size = _nbytes(t)
            if size is None or not (t is None or type(t) is np.ndarray or direct(t)):
                return False  # (the loop's way says what is wrong with it, or stages it)
            nbytes += size
    if nbytes > SMALL_BYTES:
        return False
    _origin.mark_thread()  # (its origin is the thread's, as on the loop's way)
    # From here this thread looks at the members' rings, where it may wait for them: those
    # that send meanwhile need not wake its loop's thread (the steps take their messages as
    # soon as they post). With no poll budget it will not wait here, so it does not say so.
    budget = _busy_poll.budget()
    if budget > 0:
        g.transport.look_here(g.ranks, True)
    try:
        work = g.collective(name, *args, timeout=timeout, here=budget)
    except NotContiguousError:
        return False  # (refused before it was numbered: the loop's way copies it)
    finally:
        if budget > 0:
            g.transport.look_here(g.ranks, False)
    try:
        lt.wait_future(_work.take_outcome(work))
    except asyncio.CancelledError:
        raise DistError("the operation was cancelled") from None
    return True


def send_here(tensor: Any, dst: int, group: Any, tag: int) -> bool:
    """A blocking ``send`` done on this thread where it can be (``ProcessGroup.send_here``);
    False: it goes the loop's way."""
    return _sent_here(tensor, dst, group, tag) is not None


def _sent_here(tensor: Any, dst: int, group: Any, tag: int) -> LoopThread | None:
    """``send_here``: the runtime's loop thread once sent; None: it goes the loop's way."""
    lt = _here_thread()
    if lt is None:
        return None
    try:
        return lt if resolve_group(group).send_here(tensor, dst, tag) else None
    except NotContiguousError:
        return None  # (the loop's way sends a contiguous copy)


def _nbytes(t: Any) -> int | None:
    """The bytes of a tensor argument (0: an absent one, such as a gather list off the root), or
    None where it is no plain tensor (a sparse tensor has no byte count: torch raises)."""
    if t is None:
        return 0
    if type(t) is np.ndarray:
        return t.nbytes
    try:
        size = t.nbytes
    except Exception:
        return None
    return size if type(size) is int else None


def isend_here(tensor: Any, dst: int, group: Any, tag: int) -> Work | None:
    """A non-blocking ``isend`` done on this thread where it can be, as ``send_here``: its Work,
    complete (the message is in the peer's ring, ``tensor`` free again); None: it goes the
    loop's way."""
    lt = _sent_here(tensor, dst, group, tag)
    if lt is None:
        return None
    return Work.completed(lt.loop, f"send to rank {dst} (tag {tag})")


def irecv_here(tensor: Any, src: int, group: Any, tag: int) -> Work | None:
    """A non-blocking ``irecv`` posted on this thread (``ProcessGroup.irecv_here``): its Work,
    done where its message had come, else one whose ``wait()`` takes the message on the
    waiting thread (``_PostedHere``): a stream of small messages need not hop to the loop's
    thread for each. None: it goes the loop's way."""
    if _here_thread() is None:
        return None
    g = resolve_group(group)
    try:
        fut = g.irecv_here(tensor, src, tag)
    except NotContiguousError:
        return None
    if fut is None:
        return None
    if fut.done():
        return g.received_here(fut, src, tag)
    return _PostedHere(fut, g.recv_name(src, tag), g)


class _PostedHere(Work):
    """The Work of an ``irecv`` that a caller's thread posted (``irecv_here``) before its
    message came.

    ``wait()`` takes the message on the waiting thread, as a blocking ``recv`` does
    (``ProcessGroup.wait_here_recv``: the poll budget, then a sleep the writer ends); where it
    has not come by then, the receive is handed to the loop's thread, which tracks it from
    then on as any receive. Its timeout counts from the call either way.

    Why the hand-over is one way: a future completed on another thread than the loop's must
    have no callback (its callbacks are the loop's to run). Whatever adds one (the wait on
    the loop's thread, ``get_future``, ``await``, the report of a Work dropped unseen) hands
    the receive over first, and once it is handed over, no thread takes its message here. The
    lock keeps a wait here and a hand-over from overlapping.
    """

    __slots__ = ("_group", "_handed", "_lock")

    def __init__(self, future: asyncio.Future[Any], name: str, group: ProcessGroup) -> None:
        super().__init__(future, name)
        self._group = group
        self._handed = False
        self._lock = threading.Lock()

    def wait(self, timeout: float | datetime.timedelta | None = None) -> bool:
        fut = self._future
        # (the loop's thread raises below; asyncio's public check raises where none runs)
        if not fut.done() and asyncio._get_running_loop() is not self._loop:
            if not self._handed and self._lock.acquire(blocking=False):
                try:
                    if not self._handed:
                        # (a time limit of the caller's is kept to the letter: a look, no wait)
                        unlimited = timeout is None or timeout == datetime.timedelta(0)
                        self._group.wait_here_recv(fut, _busy_poll.budget() if unlimited else None)
                finally:
                    self._lock.release()
            if not fut.done():
                self._hand_over()
        return super().wait(timeout)

    def get_future(self) -> concurrent.futures.Future[Any]:
        self._hand_over()
        return super().get_future()

    def __await__(self) -> Generator[Any, None, Any]:
        self._hand_over()
        return super().__await__()

    def __del__(self) -> None:
        if not getattr(self, "_handed", True) and not self._future.done():
            self._handed = True  # (nobody else holds it: nothing waits here)
            with contextlib.suppress(RuntimeError):  # (the loop is closed: nothing to track)
                self._loop.call_soon_threadsafe(self._group.follow_here, self._future)
        super().__del__()

    def _hand_over(self) -> None:
        """Have the loop's thread track the receive from now (no thread takes it here then)."""
        with self._lock:
            if self._handed:
                return
            self._handed = True
        follow = functools.partial(self._group.follow_here, self._future)
        lt = get_loop_thread()
        if lt.in_loop_thread():
            follow()
        else:
            lt.call(follow)


def recv_here(tensor: Any, src: int, group: Any, tag: int) -> tuple[bool, Any]:
    """A blocking ``recv`` done on this thread where it can be, waiting for its message as the
    transport's ``wait_here`` does: ``(True, sender)``, or ``(False, None)``: it goes the
    loop's way. Raises the receive's error."""
    if _here_thread() is None:
        return False, None
    g = resolve_group(group)
    try:
        fut = g.recv_here(tensor, src, tag, _busy_poll.budget())
    except NotContiguousError:
        return False, None  # (the loop's way copies it)
    if fut is None:
        return False, None
    if fut.done():
        return True, g.outcome_here(fut, src, tag)
    return True, call(lambda: g.follow_recv(fut, src, tag), False)
