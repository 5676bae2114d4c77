"""Timeouts, frozen and slow ranks, mismatches and monitored_barrier, with real processes
(FAULTS.md rows 2, 3, 8, 9, 10; SPEC §5: a timeout does not poison the group).

T is a group timeout of 3 s (a group made with ``new_group(timeout=T)``, so that the
rendezvous itself is not squeezed on a loaded machine).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import numpy as np
import pytest
from support.faults import record

import aiodist as dist
import aiodist.sync as sdist
from aiodist.face.world import world
from aiodist.testing import spawn

pytestmark = pytest.mark.timeout(120)

T = 3.0


async def _store_barrier(name: str, size: int) -> None:
    """Wait until every rank has arrived; rank 0, which hosts the store, also waits until every
    rank has seen that, so a rank that destroys its group right after cannot close the store
    under one still polling it."""
    store = world().store
    await store.add(f"barrier/{name}", 1)
    while int(await store.get(f"barrier/{name}")) < size:
        await asyncio.sleep(0.02)
    await store.add(f"barrier/{name}/seen", 1)
    if dist.get_rank() == 0:
        while int(await store.get(f"barrier/{name}/seen")) < size:
            await asyncio.sleep(0.02)


async def _skip_slow_mismatch(rank: int, size: int) -> dict[str, Any]:
    await dist.init_process_group("tcp", "env://", timeout=30)
    g = await dist.new_group(timeout=T)
    pair = await dist.new_group([0, 1], timeout=T)
    out: dict[str, Any] = {}
    # -- mismatches (rows 8, 9): both sides, fast, and the group goes on
    if rank in (0, 1):
        z = np.zeros(10, np.float32)
        cases = [
            lambda: dist.all_reduce(z, group=pair) if rank == 0 else dist.broadcast(z, 0, group=pair),
            lambda: dist.all_reduce(np.zeros(10 if rank == 0 else 20, np.float32), group=pair),
            lambda: dist.all_reduce(np.zeros(10, np.float32 if rank == 0 else np.float64), group=pair),
        ]
        out["mismatch"] = []
        for case in cases:
            t0 = time.monotonic()
            try:
                await case()
                out["mismatch"].append(("no error", 0.0))
            except dist.CollectiveMismatchError as exc:
                out["mismatch"].append((str(exc), time.monotonic() - t0))
        ok = np.ones(3, np.int64)
        await dist.all_reduce(ok, group=pair)
        out["pair_after"] = ok.tolist()
    # -- a slow rank, well inside the timeout: no false failure
    x = np.full(1 << 16, rank + 1, np.float64)
    if rank == 1:
        await asyncio.sleep(0.6 * T)
    t0 = time.monotonic()
    await dist.all_reduce(x, group=g)
    out["slow_ok"] = bool((x == 10).all())
    # -- rank 2 skips a collective (row 2)
    if rank == 2:
        await asyncio.sleep(T + 2.5)
    else:
        t0 = time.monotonic()
        try:
            await dist.all_reduce(x, group=g)
            out["skip"] = ("no error", 0.0)
        except dist.DistTimeoutError as exc:
            out["skip"] = (str(exc), time.monotonic() - t0)
    # nobody leaves before every rank has seen its own timeout (a rank that has left fails
    # the others' pending operations that need it, sooner than their timeout)
    await _store_barrier("end", size)
    # The ranks disagree about #1: a barrier (the usual reflex) is refused, on every rank,
    # saying so; resync brings the group back in step.
    try:
        await dist.barrier(group=g)
        out["barrier"] = "no error"
    except dist.GroupOutOfStepError as exc:
        out["barrier"] = str(exc)
    report = await dist.resync(g)
    out["report"] = (report.next_op, report.ranks_at, str(report))
    y = np.full(4, rank + 1, np.int64)
    await dist.all_reduce(y, group=g)
    out["after_resync"] = y.tolist()
    await _store_barrier("end2", size)
    await dist.destroy_process_group()
    return out


def test_skipped_collective_times_out_naming_it_and_slow_is_not_failed() -> None:
    res = spawn(_skip_slow_mismatch, 4, timeout=90)
    for rank in (0, 1):
        (m1, t1), (m2, t2), (m3, t3) = res[rank]["mismatch"]
        assert "all_reduce" in m1 and "broadcast" in m1, m1
        assert "x 10" in m2 and "x 20" in m2 and "rank 0" in m2 and "rank 1" in m2, m2
        assert "float32" in m3 and "float64" in m3, m3
        for took in (t1, t2, t3):
            assert took < 1.0  # FAULTS #8/#9: within 1 s
            record(8, "CollectiveMismatchError on both ranks", took)
        assert res[rank]["pair_after"] == [2, 2, 2]
    assert all(r["slow_ok"] for r in res)
    for rank in (0, 1, 3):
        msg, took = res[rank]["skip"]
        assert "all_reduce #1 on rank" in msg and f"reached its timeout of {T:g} s" in msg, msg
        assert "waiting for data from rank" in msg, msg
        assert T - 0.05 <= took <= T + 2.0, took  # FAULTS #2: in [T, T+2 s]
        # FAULTS #29: every rank names the one that never entered, not only its neighbour
        assert "rank 2 never entered it (it is at operation #0)" in msg, msg
        assert "out of step" in msg and "resync" in msg, msg
        record(2, f"DistTimeoutError (T = {T:g} s)", took)
    for rank in range(4):
        r = res[rank]
        assert "out of step" in r["barrier"] and "call resync" in r["barrier"], r["barrier"]
        assert r["report"][0] == 2 and r["report"][1] == {0: 2, 1: 2, 2: 1, 3: 2}, r["report"]
        assert r["after_resync"] == [10] * 4


async def _frozen(rank: int, size: int) -> dict[str, Any]:
    await dist.init_process_group("tcp", "env://", timeout=30)
    g = await dist.new_group(timeout=T)
    store = world().store
    await store.set(f"pid/{rank}", str(os.getpid()))
    x = np.ones(1 << 20, np.float32)  # 4 MiB
    await dist.all_reduce(x, group=g)  # #0
    out: dict[str, Any] = {}
    await _store_barrier("before", size)
    x[:] = rank + 1
    if rank == 0:
        # Freeze rank 2 once it has entered #1, before our own part of #1 starts: nobody can
        # finish #1 without it. (A rank frozen before it entered an operation the others
        # abandoned leaves the group out of step: tests/faults/test_faults_resync.py.)
        pid2 = int(await store.get("pid/2"))
        await store.get("entered/2")
        os.kill(pid2, signal.SIGSTOP)
        stopped = time.monotonic()
    t0 = time.monotonic()
    try:
        if rank == 2:
            work = dist.all_reduce(x, group=g)  # #1
            await asyncio.sleep(0)  # its task runs: it posts its receives, sends its first part
            await store.set("entered/2", b"1")
            await work
        else:
            await dist.all_reduce(x, group=g)  # #1
        out["frozen_op"] = ("no error", time.monotonic() - t0)
    except dist.DistTimeoutError as exc:
        out["frozen_op"] = (str(exc), time.monotonic() - t0)
    if rank == 0:
        await asyncio.sleep(max(0.0, T + 1.0 - (time.monotonic() - stopped)))
        os.kill(pid2, signal.SIGCONT)  # rank 2 goes on with #1: its frames arrive late
    await _store_barrier("after", size)
    y = np.full(1 << 20, rank + 1, np.float32)
    await dist.all_reduce(y, group=g)  # #2: exact, untouched by #1's late frames
    out["next_ok"] = bool((y == 10).all())
    await asyncio.sleep(0.2)
    out["held"] = world().transport.mailbox.unexpected_bytes
    out["broken"] = g.broken is not None
    await dist.destroy_process_group()
    return out


def test_frozen_rank_times_out_then_its_late_frames_are_discarded() -> None:
    res = spawn(_frozen, 4, timeout=90)
    for rank in (0, 1, 3):
        msg, took = res[rank]["frozen_op"]
        assert "all_reduce #1" in msg and "reached its timeout" in msg, msg
        assert T - 0.05 <= took <= T + 2.0, took  # FAULTS #3: as #2
        record(3, f"DistTimeoutError while a rank is SIGSTOPped (T = {T:g} s)", took)
    for r in res:
        assert r["next_ok"], res
        assert r["held"] == 0 and not r["broken"], res


async def _monitored(rank: int, size: int) -> dict[str, Any]:
    await dist.init_process_group("tcp", "env://", timeout=30)
    out: dict[str, Any] = {}
    await dist.monitored_barrier(timeout=10)  # everybody present: passes
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # dead
    if rank == 1:
        await asyncio.sleep(T + 1.0)  # absent from the first one
    else:
        t0 = time.monotonic()
        try:
            await dist.monitored_barrier(timeout=T, wait_all_ranks=True)
            out["all"] = ("no error", 0.0, "")
        except dist.DistError as exc:
            out["all"] = (str(exc), time.monotonic() - t0, type(exc).__name__)
    g = await dist.new_group(timeout=30)  # every live rank makes it, in order
    t0 = time.monotonic()
    try:
        await dist.monitored_barrier(g, timeout=T)  # rank 2 is dead: rank 0 knows at once
        out["first"] = ("no error", 0.0, "")
    except dist.DistError as exc:
        out["first"] = (str(exc), time.monotonic() - t0, type(exc).__name__)
    await dist.destroy_process_group()
    return out


def test_monitored_barrier_names_absent_and_dead_ranks() -> None:
    res = spawn(_monitored, 4, timeout=60, expect_failure=[2])
    msg, took, kind = res[0]["all"]
    assert "ranks 1, 2 failed to pass monitored_barrier in 3000 ms" in msg, msg
    assert kind == "DistTimeoutError"
    assert T - 0.05 <= took <= T + 1.5, took  # FAULTS #10: after T
    record(10, "monitored_barrier(wait_all_ranks) on rank 0 names ranks 1, 2", took)
    msg3, _, _ = res[3]["all"]
    assert "ranks 1, 2 failed to pass monitored_barrier" in msg3 and "rank 0" in msg3, msg3
    msg, took, kind = res[0]["first"]
    assert "rank 2 failed to pass monitored_barrier" in msg and kind == "DistNetworkError", msg
    assert took < 1.0, took
    for rank in (1, 3):
        assert "rank 2 failed to pass monitored_barrier" in res[rank]["first"][0], res[rank]


def _sync_monitored(rank: int, size: int) -> Any:
    sdist.init_process_group("gloo", timeout=30)
    sdist.monitored_barrier(timeout=5)
    out = None
    if rank == 1:
        time.sleep(2.0)  # alive, but absent
    else:
        t0 = time.monotonic()
        try:
            sdist.monitored_barrier(timeout=1.0)
        except sdist.DistTimeoutError as exc:
            out = (str(exc), time.monotonic() - t0)
    sdist.destroy_process_group()
    return out


def test_monitored_barrier_sync_face() -> None:
    res = spawn(_sync_monitored, 2, timeout=40)
    msg, took = res[0]
    assert "Rank 1 failed to pass monitoredBarrier in 1000 ms" in msg and 0.95 < took < 3, res
