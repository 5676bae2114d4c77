"""Ranks as tasks on one event loop, joined by the in-memory transport."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiodist.group import ProcessGroup
from aiodist.transport.memory import MemoryFabric

__all__ = ["memory_world", "run_memory_world"]

T = TypeVar("T")


def memory_world(world_size: int, timeout: float = 30.0) -> tuple[MemoryFabric, list[ProcessGroup]]:
    """A fabric and one default group per rank (call from inside a running loop)."""
    fabric = MemoryFabric(world_size)
    groups = [ProcessGroup(t, range(world_size), 0, timeout=timeout) for t in fabric.transports]
    return fabric, groups


async def run_memory_world(
    world_size: int, fn: Callable[[ProcessGroup], Awaitable[T]], timeout: float = 30.0
) -> list[T]:
    """Run ``fn(group)`` for every rank concurrently; results in rank order."""
    fabric, groups = memory_world(world_size, timeout)
    try:
        return list(await asyncio.wait_for(asyncio.gather(*(fn(g) for g in groups)), timeout))
    finally:
        for t in fabric.transports:
            t.abort()
