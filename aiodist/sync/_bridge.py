"""The thread hop from a user's thread to the runtime loop thread.

A blocking call starts its operation on the loop thread and waits for it; with
``async_op=True`` it returns the ``Work`` (whose ``wait()`` blocks the calling thread).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiodist._loop_thread import get_loop_thread
from aiodist.work import Work

__all__ = ["call", "run"]


async def _start(fn: Callable[[], Work]) -> Work:
    return fn()


async def _start_and_wait(fn: Callable[[], Work]) -> Any:
    return await fn()


def call(fn: Callable[[], Work], async_op: bool) -> Any:
    """Start ``fn()`` (which returns a Work) on the loop; block for its result unless ``async_op``."""
    lt = get_loop_thread()
    if async_op:
        return lt.run(_start(fn))
    return lt.run(_start_and_wait(fn))


def run(coro: Any) -> Any:
    """Run a coroutine (init, new_group, destroy...) on the loop thread and block for its result."""
    return get_loop_thread().run(coro)
