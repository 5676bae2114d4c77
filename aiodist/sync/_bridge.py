"""The thread hop from a user's thread to the runtime loop thread.

A blocking call starts its operation on the loop thread and waits for it; with
``async_op=True`` it returns the ``Work`` (whose ``wait()`` blocks the calling thread).
Operations are started by a plain callback and waited on with the thread's own lock
(``aiodist._loop_thread``): no Task and no ``concurrent.futures.Future`` on the hot path.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from aiodist._loop_thread import get_loop_thread
from aiodist._staging import on_caller_stream
from aiodist.errors import DistError
from aiodist.work import Work

__all__ = ["call", "on_loop", "run"]

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
        return lt.call(fn)
    try:
        return lt.call_until_done(lambda: fn()._future)
    except asyncio.CancelledError:
        raise DistError("the operation was cancelled") from None


def on_loop(fn: Callable[[], T]) -> T:
    """Run the plain function ``fn`` on the loop thread (where the runtime's objects live)."""
    return get_loop_thread().call(fn)


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine (init, new_group, destroy...) on the loop thread and block for its result."""
    return get_loop_thread().run(coro)
