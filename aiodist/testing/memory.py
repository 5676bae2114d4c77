"""Ranks as tasks on one event loop, joined by the in-memory transport."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from aiodist.group import ProcessGroup
from aiodist.runtime import origin as _origin
from aiodist.settings import Settings
from aiodist.transport.memory import MemoryFabric

__all__ = ["memory_world", "run_memory_world"]

T = TypeVar("T")


def memory_world(
    world_size: int,
    timeout: float = 30.0,
    hosts: Sequence[str] | None = None,
    shared_memory: bool = False,
    host_algos: str = "auto",
) -> tuple[MemoryFabric, list[ProcessGroup]]:
    """A fabric and one default group per rank (call from inside a running loop).

    ``hosts``: each rank's host id, as if the ranks ran on those hosts (the host-aware
    collectives plan with them); None: no host facts, as before. ``shared_memory``: say that
    ranks of one host reach each other through shared memory (the automatic choice of the
    one-host direct algorithms then runs them). ``host_algos``: ``AIODIST_HOST_ALGOS`` as the
    ranks agreed on it (``"direct"``: the one-host direct forms whatever carries the data).
    """
    # Read as an init reads them (the process-wide ones, such as the debug level, applied).
    fabric = MemoryFabric(world_size, settings=Settings.read().apply())
    if hosts is not None:
        if len(hosts) != world_size:
            raise ValueError(f"hosts names {len(hosts)} ranks, the world has {world_size}")
        shm = tuple(shared_memory and sum(h == k for k in hosts) > 1 for h in hosts)
        for t in fabric.transports:
            t.host_keys = tuple(hosts)
            t.shm_local = shm
            t.host_algos = host_algos
    groups = [ProcessGroup(t, range(world_size), 0, timeout=timeout) for t in fabric.transports]
    return fabric, groups


async def run_memory_world(
    world_size: int,
    fn: Callable[[ProcessGroup], Awaitable[T]],
    timeout: float = 30.0,
    hosts: Sequence[str] | None = None,
    shared_memory: bool = False,
    host_algos: str = "auto",
) -> list[T]:
    """Run ``fn(group)`` for every rank concurrently; results in rank order (``hosts``,
    ``shared_memory``, ``host_algos``: see ``memory_world``)."""
    fabric, groups = memory_world(world_size, timeout, hosts, shared_memory, host_algos)
    # Each rank's task is the root of its own lineage, named alike on every rank, as the main
    # tasks of separate processes are (the tasks it creates are then named as theirs would be).
    loop = asyncio.get_running_loop()
    _origin.install(loop)

    async def rank(g: ProcessGroup) -> T:
        return await fn(g)

    ranks = [loop.create_task(rank(g), context=_origin.root_context("rank")) for g in groups]
    try:
        return list(await asyncio.wait_for(asyncio.gather(*ranks), timeout))
    finally:
        for t in fabric.transports:
            t.abort()
