"""Polling helpers shared by the socket-level tests (store server, transport)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def eventually(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait until ``cond()`` holds; fail the test if it does not within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def closed_within(reader: asyncio.StreamReader, timeout: float) -> float:
    """Read until the other end closes the connection; return how long that took."""
    t0 = time.monotonic()
    async with asyncio.timeout(timeout):
        try:
            while await reader.read(65536):
                pass
        except ConnectionResetError:
            pass
    return time.monotonic() - t0
