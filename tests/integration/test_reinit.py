"""Recovery by destroy + init: 50 rounds of init -> all_reduce -> destroy, two ranks as processes.

Three variants, through both faces: the same MASTER_PORT every round, with a new group name
each round or the same one (a rank may reach the previous round's store while its host shuts
it down: it must look for the next one), and a new MASTER_PORT in ``os.environ`` before every
re-init (rank 0 must host the store on the new port). Every other round rank 0 leaves late, so
rank 1 surely meets the old store. Every result is checked; file descriptors and threads are
back to their baseline after every round, and memory stays bounded. Also: a replacement
process joining a rank that initialised before, and the user's own store kept across inits.
"""

from __future__ import annotations

import asyncio
import os
import resource
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.faults import fd_count

import aiodist as dist
import aiodist.sync as sdist
from aiodist.testing import free_port, spawn

pytestmark = pytest.mark.timeout(240)

ROUNDS = 50
# Every other round rank 0 tears down this much later than rank 1, so that rank 1's next init
# surely reaches the store rank 0 is about to shut down.
LAG = 0.05


Usage = tuple[int, int, int]


def _usage() -> Usage:
    """(open file descriptors, threads, peak RSS in KiB)."""
    return fd_count(), threading.active_count(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _check_round(i: int, rank: int, total: float, baseline: Usage | None) -> None:
    assert total == 1 + 2 + 2 * i, (i, rank, total)  # (rank 0: 1 + i) + (rank 1: 2 + i)
    if baseline is not None:
        fds, threads, _ = _usage()
        assert fds <= baseline[0], f"round {i}: {fds} fds open, {baseline[0]} after round 0"
        assert threads <= baseline[1], f"round {i}: {threads} threads, {baseline[1]} after round 0"


def _end_round(i: int, rank: int, total: float, port: int, baseline: Usage | None) -> Usage | None:
    """After destroy: move to the next port (if any), check the round, take the baseline after round 0."""
    if port:
        os.environ["MASTER_PORT"] = str(port)
    _check_round(i, rank, total, baseline)
    return _usage() if i == 0 else baseline


def _summary(t0: float, baseline: Usage | None) -> dict[str, Any]:
    assert baseline is not None
    return {"seconds": time.monotonic() - t0, "rss_round0": baseline[2], "rss_end": _usage()[2]}


def _lag(rank: int, i: int) -> float:
    return LAG if rank == 0 and i % 2 else 0.0


async def _async_rounds(rank: int, size: int, new_port: bool, new_name: bool) -> dict[str, Any]:
    baseline, t0 = None, time.monotonic()
    for i in range(ROUNDS):
        await dist.init_process_group("tcp", "env://", timeout=30, group_name=f"round-{i * new_name}")
        t = np.array([rank + 1.0 + i])
        await dist.all_reduce(t)
        p = np.array([free_port() if rank == 0 and new_port else 0], np.int64)
        if new_port:
            await dist.broadcast(p, 0)
        await asyncio.sleep(_lag(rank, i))
        await dist.destroy_process_group()
        baseline = _end_round(i, rank, float(t[0]), int(p[0]), baseline)
    return _summary(t0, baseline)


def _sync_rounds(rank: int, size: int, new_port: bool, new_name: bool) -> dict[str, Any]:
    baseline, t0 = None, time.monotonic()
    for i in range(ROUNDS):
        sdist.init_process_group("gloo", "env://", timeout=30, group_name=f"round-{i * new_name}")
        t = np.array([rank + 1.0 + i])
        sdist.all_reduce(t)
        p = np.array([free_port() if rank == 0 and new_port else 0], np.int64)
        if new_port:
            sdist.broadcast(p, 0)
        time.sleep(_lag(rank, i))
        sdist.destroy_process_group()
        baseline = _end_round(i, rank, float(t[0]), int(p[0]), baseline)
    return _summary(t0, baseline)


@pytest.mark.parametrize("face", ["async", "sync"])
@pytest.mark.parametrize(
    "port", ["same port, new group name", "same port, same group name", "new port each round"]
)
def test_fifty_rounds_of_destroy_and_init(face: str, port: str) -> None:
    fn = _async_rounds if face == "async" else _sync_rounds
    args = (port.startswith("new"), "new group" in port)
    res = spawn(fn, 2, args=args, timeout=200, env={"OMP_NUM_THREADS": "1"})
    for r in res:
        # memory roughly bounded: 50 rounds add less than 64 MiB of peak RSS to round 0's
        assert r["rss_end"] - r["rss_round0"] < 64 << 10, r
    print(f"{face}, {port}: {max(r['seconds'] for r in res):.1f} s for {ROUNDS} rounds")


async def _replacement(rank: int, size: int, out: str) -> list[float]:
    """Process 0 is rank 0 twice; process 1 is rank 1 once, then process 2 takes rank 1 over."""
    os.environ["WORLD_SIZE"] = "2"
    first_done = Path(out, "first-done")
    if rank == 2:
        while not first_done.exists():
            await asyncio.sleep(0.02)
        os.environ["RANK"] = "1"  # a fresh process, in its first init, joins a rank 0 in its second
    results = []
    for i in range(2 if rank == 0 else 1):
        await dist.init_process_group("tcp", "env://", timeout=30)
        t = np.array([1.0 + i])  # round 2: 2.0 (rank 0) + 1.0 (the replacement, in its round 1)
        await dist.all_reduce(t)
        results.append(float(t[0]))
        await dist.destroy_process_group()
        if rank == 1:
            first_done.touch()
    return results


def test_a_replacement_process_joins_ranks_that_initialised_before(tmp_path: Path) -> None:
    assert spawn(_replacement, 3, args=(str(tmp_path),), timeout=60) == [[2.0, 3.0], [2.0], [3.0]]


async def _own_store_rounds(rank: int, size: int, port: int) -> list[float]:
    """The user's own store, kept across inits: each init still gets a namespace of its own."""
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=30)
    out = []
    for i in range(5):
        await dist.init_process_group(store=store, rank=rank, world_size=size, timeout=30)
        t = np.array([rank + 1.0 + i])
        await dist.all_reduce(t)
        out.append(float(t[0]))
        await asyncio.sleep(_lag(rank, i))
        await dist.destroy_process_group()
    await store.set(f"done/{rank}", b"1")
    if rank == 0:  # the host closes the store only once nobody needs it any more
        await store.wait([f"done/{r}" for r in range(size)])
    await store.aclose()
    return out


def test_rounds_through_the_users_own_store() -> None:
    expected = [3.0 + 2 * i for i in range(5)]
    assert spawn(_own_store_rounds, 2, args=(free_port(),), timeout=60) == [expected, expected]
