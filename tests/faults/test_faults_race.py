"""A failure that reaches an operation before its task first runs (FAULTS row 32), and
operations still in flight when their group is destroyed.

The race is provoked deterministically on the in-memory transport: the failure is delivered
in the same loop turn that started the operation, before the operation's task has run once.
"""

from __future__ import annotations

import asyncio
import gc
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aiodist as dist
from aiodist.collectives import select
from aiodist.testing import memory_world, spawn
from aiodist.transport.base import COLL

pytestmark = pytest.mark.timeout(60)


def _never_awaited(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "never awaited" in str(w.message)]


async def test_peer_abort_before_the_first_step_raises_its_cause() -> None:
    fabric, groups = memory_world(3)
    g = groups[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        work = dist.all_reduce(np.ones(4, np.float32), group=g)
        # Rank 2's notice that it abandoned this operation arrives before its task ran once.
        g.transport._abort_reported(2, (g.gid, COLL, 0), "rank 2 abandoned all_reduce #0: rank 1 was lost")
        with pytest.raises(dist.DistNetworkError) as info:
            await work
        del work
        gc.collect()
    assert "rank 2 abandoned all_reduce #0: rank 1 was lost" in str(info.value)
    assert not _never_awaited(caught)
    assert g.broken is not None  # a lost peer's notice breaks the group, as when it arrives later
    for t in fabric.transports:
        t.abort()


async def test_abort_before_the_first_step_raises_dist_error() -> None:
    fabric, groups = memory_world(2)
    g = groups[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # A large all_reduce runs as a task, aborted before its first step; a small broadcast
        # runs as steps, its first taken in the call, and waits for the root's data.
        big = np.ones(select.ALLREDUCE_RING_BYTES // 4, np.float32)
        works = [dist.all_reduce(big, group=g), dist.broadcast(np.ones(2), 1, group=g)]
        g.abort("the process group was destroyed")
        for work, name in zip(works, ("all_reduce #0", "broadcast #1"), strict=True):
            with pytest.raises(dist.DistError) as info:
                await work
            assert not isinstance(info.value, asyncio.CancelledError)
            assert str(info.value) == (
                f"{name} on rank 0: the process group was destroyed while it was in flight"
            )
        del works
        gc.collect()
    assert not _never_awaited(caught)
    for t in fabric.transports:
        t.abort()


async def _destroy_in_flight(rank: int, size: int) -> dict[str, Any]:
    await dist.init_process_group("tcp", "env://", timeout=30)
    await dist.all_reduce(np.ones(4, np.int64))  # #0: everybody is connected and in step
    forgotten = []
    if rank == 0:
        # A forgotten await: three operations started, the group destroyed under them.
        forgotten = [dist.all_reduce(np.ones(4, np.int64)) for _ in range(3)]
    await dist.destroy_process_group()
    out: dict[str, Any] = {"errors": []}
    for work in forgotten:
        try:
            await work
            out["errors"].append("completed")
        except dist.DistError as exc:
            out["errors"].append(f"{type(exc).__name__}: {exc}")
    return out


def test_destroy_with_operations_in_flight_names_them(tmp_path: Path) -> None:
    res = spawn(_destroy_in_flight, 2, timeout=40)
    assert res[0]["errors"] == [
        f"DistError: all_reduce #{n} on rank 0: the process group was destroyed while it was in flight"
        for n in (1, 2, 3)
    ], res[0]
    assert res[1]["errors"] == []
