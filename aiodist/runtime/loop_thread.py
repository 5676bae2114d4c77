"""A uvloop event loop running in a daemon thread, for the blocking faces.

The sync facade and the blocking store classes run work on this loop and wait for it. One
loop thread serves the whole process (created lazily, shut down at exit), so every object of
the runtime lives on one loop no matter which face created it.

The thread hop is on the path of every small blocking call, so it is kept short: a call is
posted with ``call_soon_threadsafe`` as a plain callback (no Task, no chained futures) and
the calling thread sleeps on a pre-locked ``threading.Lock`` of its own (a ``Waiter``) that
the loop releases when the result is in. An operation that completes while it is being
started (a send the kernel took at once) wakes the caller from that same callback.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import uvloop

from aiodist.runtime import busy_poll as _busy_poll
from aiodist.runtime import origin as _origin

T = TypeVar("T")

__all__ = [
    "LoopThread",
    "Waiter",
    "block_on",
    "get_loop_thread",
    "on_loop",
    "started_loop_thread",
    "thread_waiter",
]


class Waiter:
    """A one-shot result slot that one thread blocks on and another thread fills.

    The lock is created held; ``set_result``/``set_exception`` store the outcome and release
    it; ``wait`` acquires it. A thread reuses its waiter (``thread_waiter``) from call to call,
    unless a wait was given up (timeout, KeyboardInterrupt): that waiter may still be filled
    later, so it is retired and the thread gets a fresh one.
    """

    __slots__ = ("_lock", "error", "value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self.value: Any = None
        self.error: BaseException | None = None

    def set_result(self, value: Any) -> None:
        self.value = value
        self._lock.release()

    def set_exception(self, exc: BaseException) -> None:
        self.error = exc
        self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until filled; False if ``timeout`` ran out first (the waiter is then retired)."""
        done = False
        try:
            done = self._lock.acquire(True, -1 if timeout is None else max(timeout, 0.0))
        finally:
            if not done:
                _retire(self)
        return done

    def take(self) -> Any:
        """The stored outcome of a successful ``wait`` (raising a stored error).

        The lock is held again after ``wait`` acquired it, so the waiter is ready for reuse.
        """
        value, error = self.value, self.error
        self.value = self.error = None
        if error is not None:
            try:
                raise error
            finally:
                del error
        return value

    def _fill_from(self, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled():
            self.set_exception(asyncio.CancelledError())
        elif (exc := fut.exception()) is not None:
            self.set_exception(exc)
        else:
            self.set_result(fut.result())


_local = threading.local()


def thread_waiter() -> Waiter:
    """This thread's reusable waiter (released and re-armed by each call)."""
    w: Waiter | None = getattr(_local, "waiter", None)
    if w is None:
        w = _local.waiter = Waiter()
    return w


def _retire(w: Waiter) -> None:
    if getattr(_local, "waiter", None) is w:
        _local.waiter = None


class LoopThread:
    """Owns one event loop and the thread that runs it forever."""

    def __init__(self, name: str = "aiodist-loop") -> None:
        self.loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        _origin.install(self.loop)  # collectives carry the name of the task or thread that started them
        # Poll only while a caller blocks on this loop (see ``_busy_poll``).
        _busy_poll.for_loop(self.loop, for_ops=False)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        self.loop.run_forever()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def _check_thread(self, what: str) -> None:
        if self.in_loop_thread():
            raise RuntimeError(
                f"a blocking aiodist call ({what}) was made from the runtime's own loop thread"
            )

    # -- the fast hop ------------------------------------------------------------------
    def call(self, fn: Callable[[], T]) -> T:
        """Run the plain function ``fn()`` on the loop thread; return its value or raise its error."""
        self._check_thread(getattr(fn, "__name__", "call"))
        _origin.mark_thread()  # (``fn`` runs in a copy of this thread's context)
        w = thread_waiter()
        self.loop.call_soon_threadsafe(_call_cb, fn, w)
        w.wait()
        return w.take()  # type: ignore[no-any-return]

    def call_until_done(self, start: Callable[[], asyncio.Future[T]]) -> T:
        """Run ``start()`` on the loop thread and block until the future it returns is done.

        No Task is created: the future's completion releases the caller directly, and a
        future that is already done when ``start`` returns releases it in the same callback.
        """
        self._check_thread(getattr(start, "__name__", "call"))
        _origin.mark_thread()
        w = thread_waiter()
        self.loop.call_soon_threadsafe(_start_cb, start, w)
        w.wait()
        return w.take()  # type: ignore[no-any-return]

    def wait_future(self, fut: asyncio.Future[T], timeout: float | None = None) -> tuple[bool, T | None]:
        """Block (not on the loop thread) until the loop's future ``fut`` is done.

        Returns:
            ``(True, result)``, or ``(False, None)`` if ``timeout`` ran out first.
        Raises:
            The future's exception (``CancelledError`` if it was cancelled).
        """
        return wait_future(self.loop, fut, timeout)

    # -- coroutines --------------------------------------------------------------------
    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; the returned future may be waited on from any thread."""
        _origin.mark_thread()
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and block the calling thread for its result."""
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError("a blocking aiodist call was made from the runtime's own loop thread")
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


def _call_cb(fn: Callable[[], Any], w: Waiter) -> None:
    try:
        value = fn()
    except BaseException as exc:
        w.set_exception(exc)
    else:
        w.set_result(value)


def _start_cb(start: Callable[[], asyncio.Future[Any]], w: Waiter) -> None:
    try:
        fut = start()
    except BaseException as exc:
        w.set_exception(exc)
        return
    _fill_when_done(fut, w)


def _fill_when_done(fut: asyncio.Future[Any], w: Waiter) -> None:
    """Fill ``w`` from ``fut``, now or once done; the loop polls meanwhile (a caller blocks)."""
    if fut.done():
        w._fill_from(fut)
        return
    poller = _busy_poll.for_loop(fut.get_loop())
    poller.hold()

    def done(f: asyncio.Future[Any]) -> None:
        poller.release()
        w._fill_from(f)

    fut.add_done_callback(done)


def wait_future(
    loop: asyncio.AbstractEventLoop, fut: asyncio.Future[T], timeout: float | None = None
) -> tuple[bool, T | None]:
    """Block a thread other than ``loop``'s until ``fut`` (a future of ``loop``) is done.

    See ``LoopThread.wait_future``. A wait that times out leaves the future untouched.
    """
    if fut.done():
        return True, fut.result()
    w = thread_waiter()
    loop.call_soon_threadsafe(_watch_cb, fut, w)
    if not w.wait(timeout):
        return False, None
    return True, w.take()


def _watch_cb(fut: asyncio.Future[Any], w: Waiter) -> None:
    _fill_when_done(fut, w)


_lock = threading.Lock()
_instance: LoopThread | None = None


def on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether the calling thread is the one running ``loop``."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def block_on(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T], refusal: Callable[[], BaseException]
) -> T:
    """Run ``coro`` on ``loop`` (running in another thread) and block this thread for its result.

    On ``loop``'s own thread the call would wait for itself: ``coro`` is closed and
    ``refusal()`` raised instead.
    """
    if on_loop(loop):
        coro.close()
        raise refusal()
    return asyncio.run_coroutine_threadsafe(coro, loop).result()


def started_loop_thread() -> LoopThread | None:
    """The process-wide loop thread if one was started (and not replaced), else None; starts none."""
    return _instance


def get_loop_thread() -> LoopThread:
    """The process-wide loop thread, started on first use."""
    global _instance
    inst = _instance
    if inst is not None and inst._thread.is_alive():
        return inst
    with _lock:
        if _instance is None or not _instance.thread.is_alive():
            _instance = LoopThread()
            atexit.register(_instance.stop)
        return _instance
