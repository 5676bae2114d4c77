"""Progress reports while a rendezvous waits: a callback every N seconds until the wait ends.

``AIODIST_RENDEZVOUS_LOG_INTERVAL`` (seconds, default 30) sets N; ``0`` turns the reports off.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

__all__ = ["every"]


@contextlib.asynccontextmanager
async def every(report: Callable[[float], None], period: float) -> AsyncIterator[None]:
    """Call ``report(seconds waited)`` every ``period`` seconds while the body runs (0: never)."""
    if period <= 0:
        yield
        return
    start = time.monotonic()

    async def tick() -> None:
        while True:
            await asyncio.sleep(period)
            report(time.monotonic() - start)

    task = asyncio.create_task(tick(), name="aiodist-rendezvous-progress")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
