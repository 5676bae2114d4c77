"""Memory-transport worlds whose groups run on a given backend (staged, torch's engine)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

from aiodist.backends.base import Backend
from aiodist.backends.native import NATIVE
from aiodist.backends.staged import StagedBackend, Stager
from aiodist.group import ProcessGroup
from aiodist.testing import memory_world
from aiodist.transport.memory import MemoryFabric


@contextlib.asynccontextmanager
async def open_world(size: int, timeout: float) -> AsyncIterator[tuple[MemoryFabric, list[ProcessGroup]]]:
    """``memory_world`` whose transports are aborted on the way out (whatever the test left)."""
    fabric, gs = memory_world(size, timeout=timeout)
    try:
        yield fabric, gs
    finally:
        for t in fabric.transports:
            t.abort()


def backend_world(
    backends: Sequence[Backend], timeout: float = 30.0
) -> tuple[MemoryFabric, list[ProcessGroup]]:
    """One default group per rank over the memory transport, rank i's on ``backends[i]``."""
    fabric = MemoryFabric(len(backends))
    groups = [
        ProcessGroup(t, range(len(backends)), 0, timeout=timeout, runs_on=b)
        for t, b in zip(fabric.transports, backends, strict=True)
    ]
    return fabric, groups


def staged_world(
    stagers: Sequence[Stager | None], timeout: float = 30.0
) -> tuple[MemoryFabric, list[ProcessGroup]]:
    """``backend_world`` where rank i stages through ``stagers[i]`` (None: nothing staged)."""
    return backend_world([StagedBackend(NATIVE, s) for s in stagers], timeout)
