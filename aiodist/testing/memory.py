"""Ranks as tasks on one event loop, joined by the in-memory transport."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from aiodist.group import ProcessGroup
from aiodist.transport.memory import MemoryFabric

__all__ = ["memory_world", "run_memory_world"]

T = TypeVar("T")


def memory_world(
    world_size: int, timeout: float = 30.0, hosts: Sequence[str] | None = None
) -> tuple[MemoryFabric, list[ProcessGroup]]:
    """A fabric and one default group per rank (call from inside a running loop).

    ``hosts``: each rank's host key, as if the ranks ran on those hosts (the host-aware
    collectives plan with them); None: no host facts, as before.
    """
    fabric = MemoryFabric(world_size)
    if hosts is not None:
        if len(hosts) != world_size:
            raise ValueError(f"hosts names {len(hosts)} ranks, the world has {world_size}")
        for t in fabric.transports:
            t.host_keys = tuple(hosts)
    groups = [ProcessGroup(t, range(world_size), 0, timeout=timeout) for t in fabric.transports]
    return fabric, groups


async def run_memory_world(
    world_size: int,
    fn: Callable[[ProcessGroup], Awaitable[T]],
    timeout: float = 30.0,
    hosts: Sequence[str] | None = None,
) -> list[T]:
    """Run ``fn(group)`` for every rank concurrently; results in rank order (``hosts``: see
    ``memory_world``)."""
    fabric, groups = memory_world(world_size, timeout, hosts)
    try:
        return list(await asyncio.wait_for(asyncio.gather(*(fn(g) for g in groups)), timeout))
    finally:
        for t in fabric.transports:
            t.abort()
