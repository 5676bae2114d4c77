"""A rank paused past the timeout, then resumed, with the documented recovery (FAULTS row 31).

Three ranks run all_reduce (integers, so every result is exact) in a loop with a group
timeout T; one of them, rank 0 included, is SIGSTOPped for longer than T and then resumed.
Every rank catches ``DistError``, calls ``resync`` and carries on from the operation number
the resync agreed on. The run must end in step: a long run of successful all_reduces with
exact results on every rank, a handful of errors at most (never a run of timeouts).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from typing import Any

import numpy as np
import pytest

import aiodist as dist
from aiodist.face.world import world
from aiodist.testing import spawn
from aiodist.testing.procs import free_port

pytestmark = pytest.mark.timeout(150)

T = 2.5  # the group's timeout
PAUSE = 5.0  # how long the paused rank is stopped: 2 T
TARGET = 80  # operations every rank completes in the end (the same on all: numbers are agreed)
STREAK = 20  # the run must end with this many successes in a row, on every rank


async def _paused_run(rank: int, size: int, paused: int, pause: float) -> dict[str, Any]:
    await dist.init_process_group("tcp", "env://", timeout=30)
    g = await dist.new_group(timeout=T)
    store = world().store
    t0 = time.monotonic()
    if rank == paused:
        # Not the rank itself (a stopped process cannot resume itself): a shell that stops
        # and resumes it while it is somewhere in the loop.
        pid = os.getpid()
        subprocess.Popen(["sh", "-c", f"sleep 1; kill -STOP {pid}; sleep {pause}; kill -CONT {pid}"])
    i = 0  # the group's operation number of the next all_reduce: the same on every rank
    streak, errors, reports = 0, [], []
    while i < TARGET:
        x = np.full(64, (rank + 1) * 1000 + i, np.int64)
        try:
            await dist.all_reduce(x, group=g)
            expected = 6000 + 3 * i
            assert (x == expected).all(), f"rank {rank}: all_reduce #{i} gave {x[0]}, expected {expected}"
            i += 1
            streak += 1
        except dist.DistError as exc:
            errors.append((round(time.monotonic() - t0, 2), type(exc).__name__, str(exc)))
            streak = 0
            for _ in range(5):  # a resync that times out (a member still stopped) is called again
                try:
                    report = await dist.resync(g)
                    break
                except dist.DistTimeoutError as again:
                    errors.append((round(time.monotonic() - t0, 2), type(again).__name__, str(again)))
            else:
                raise AssertionError(f"rank {rank}: resync never completed: {errors}")
            reports.append(str(report))
            i = report.next_op
        await asyncio.sleep(0.03)
    await store.add("done", 1)
    while int(await store.get("done")) < size:
        await asyncio.sleep(0.02)
    await store.add("seen", 1)
    if rank == 0:  # the store's host leaves last
        while int(await store.get("seen")) < size:
            await asyncio.sleep(0.02)
    await dist.destroy_process_group()
    return {"streak": streak, "errors": errors, "reports": reports, "took": time.monotonic() - t0}


@pytest.mark.parametrize(
    ("paused", "pause"),
    # 3 T: the others' first resync times out too, and is called again
    [(0, PAUSE), (1, PAUSE), (2, PAUSE), (0, 3 * T)],
)
def test_paused_rank_then_resync_converges(paused: int, pause: float) -> None:
    res = spawn(_paused_run, 3, args=(paused, pause), timeout=130)
    for rank, r in enumerate(res):
        assert r["streak"] >= STREAK, (rank, r)
        # a few errors around the pause, then none: never a run of timeouts
        assert 1 <= len(r["errors"]) <= 6, (rank, r["errors"])
        assert r["reports"], (rank, r)
        last_error_at = max(t for t, _, _ in r["errors"])
        assert last_error_at < 1.0 + pause + 3 * T, (rank, r["errors"])
    # the paused rank's first error came after it resumed, the others' while it was stopped
    print({rank: (r["errors"], r["reports"]) for rank, r in enumerate(res)})


def _sync_skip(rank: int, size: int) -> dict[str, Any]:
    import aiodist.sync as sdist

    sdist.init_process_group("gloo", timeout=30)
    g = sdist.new_group(timeout=2.0)
    out: dict[str, Any] = {}
    x = np.full(4, rank + 1, np.int64)
    if rank == 0:  # rank 1 skips this one
        try:
            sdist.all_reduce(x, group=g)
        except sdist.DistTimeoutError as exc:
            out["timeout"] = str(exc)
    else:
        time.sleep(3.0)
        try:
            sdist.barrier(group=g)  # the reflex after a timeout: refused, with the remedy
        except sdist.GroupOutOfStepError as exc:
            out["barrier"] = str(exc)
    report = sdist.resync(g)
    out["next_op"] = report.next_op
    x[:] = rank + 1
    sdist.all_reduce(x, group=g)
    out["after"] = x.tolist()
    sdist.barrier()
    sdist.destroy_process_group()
    return out


def test_sync_face_resync_after_a_skipped_collective() -> None:
    res = spawn(_sync_skip, 2, timeout=60)
    assert "rank 1 never entered it (it has started no operation on the group yet)" in res[0]["timeout"], res[
        0
    ]
    assert "out of step" in res[1]["barrier"] and "call resync" in res[1]["barrier"], res[1]
    assert res[0]["next_op"] == res[1]["next_op"] == 1
    assert res[0]["after"] == res[1]["after"] == [3] * 4


def _resync_at_once(rank: int, size: int, face: str, ports: list[int]) -> list[Any]:
    """Every rank calls resync right after init_process_group and right after new_group.

    Each round is a job of its own, at a port of its own: re-joining at the address of a job
    just destroyed is not what this tests (test_reinit.py does)."""
    out = []
    for port in ports:
        os.environ["MASTER_PORT"] = str(port)
        if face == "sync":
            import aiodist.sync as sdist

            sdist.init_process_group("gloo", timeout=10)
            first = sdist.resync()
            g = sdist.new_group(timeout=10)
            second = sdist.resync(g)
            x = np.full(4, rank + 1, np.int64)
            sdist.all_reduce(x)
            sdist.all_reduce(x, group=g)
            sdist.destroy_process_group()
        else:

            async def run() -> tuple[Any, Any, np.ndarray]:
                await dist.init_process_group("tcp", "env://", timeout=10)
                first = await dist.resync()
                g = await dist.new_group(timeout=10)
                second = await dist.resync(g)
                x = np.full(4, rank + 1, np.int64)
                await dist.all_reduce(x)
                await dist.all_reduce(x, group=g)
                await dist.destroy_process_group()
                return first, second, x

            first, second, x = asyncio.run(run())
        out.append((first.next_op, second.next_op, x.tolist()))
    return out


@pytest.mark.parametrize("face", ["async", "sync"])
@pytest.mark.parametrize("size", [2, 3])
def test_resync_right_after_init_and_new_group(face: str, size: int) -> None:
    """FAULTS row 37: a member's resync proposal can reach a rank before that rank has created
    the group; it waits there for the group instead of being dropped."""
    res = spawn(_resync_at_once, size, args=(face, [free_port() for _ in range(4)]), timeout=120)
    total = sum(range(1, size + 1))
    for r in range(size):
        assert res[r] == [(0, 0, [total * size] * 4)] * 4, res
