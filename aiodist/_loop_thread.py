"""A uvloop event loop running in a daemon thread, for the blocking faces.

The sync facade and the blocking store classes submit coroutines here and wait for them.
One loop thread serves the whole process (created lazily, shut down at exit), so every
object of the runtime lives on one loop no matter which face created it.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")

__all__ = ["LoopThread", "get_loop_thread"]


class LoopThread:
    """Owns one event loop and the thread that runs it forever."""

    def __init__(self, name: str = "aiodist-loop") -> None:
        self.loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
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

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; the returned future may be waited on from any thread."""
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


_lock = threading.Lock()
_instance: LoopThread | None = None


def get_loop_thread() -> LoopThread:
    """The process-wide loop thread, started on first use."""
    global _instance
    with _lock:
        if _instance is None or not _instance.thread.is_alive():
            _instance = LoopThread()
            atexit.register(_instance.stop)
        return _instance
