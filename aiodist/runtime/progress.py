"""Progress reports while a rendezvous waits: a callback every N seconds until the wait ends.

``AIODIST_RENDEZVOUS_LOG_INTERVAL`` (seconds, default 30) sets N; ``0`` turns the reports off.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable

from aiodist.errors import DistValueError

__all__ = ["every", "interval_from_env"]

DEFAULT_INTERVAL = 30.0


def interval_from_env() -> float:
    """Seconds between progress reports (``AIODIST_RENDEZVOUS_LOG_INTERVAL``; 0: none)."""
    raw = os.environ.get("AIODIST_RENDEZVOUS_LOG_INTERVAL", "").strip()
    if not raw:
        return DEFAULT_INTERVAL
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise DistValueError(
            f"AIODIST_RENDEZVOUS_LOG_INTERVAL={raw!r} must be a number of seconds (0 turns the reports off)"
        )
    return value


@contextlib.asynccontextmanager
async def every(report: Callable[[float], None], interval: float | None = None) -> AsyncIterator[None]:
    """Call ``report(seconds waited)`` every ``interval`` seconds while the body runs."""
    period = interval_from_env() if interval is None else interval
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
