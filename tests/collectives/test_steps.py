"""Collectives run as steps (``aiodist.collectives.steps``): the ``Stepper`` on its own, and the
small all_reduce and the barrier, which run as steps with no task, through every way a
collective ends (completion, a rank's disagreement, a timeout and resync, a lost member)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from support.worlds import open_world

import aiodist as dist
from aiodist import work as _work
from aiodist.collectives import select
from aiodist.collectives.steps import Stepper, Steps
from aiodist.group import ProcessGroup
from aiodist.testing import run_memory_world

pytestmark = pytest.mark.timeout(30)


class _Ended:
    def __init__(self) -> None:
        self.calls: list[BaseException | None] = []

    def __call__(self, exc: BaseException | None) -> None:
        self.calls.append(exc)


async def test_a_stepper_runs_each_step_once_the_futures_of_the_one_before_are_done() -> None:
    loop = asyncio.get_running_loop()
    a, b, c = loop.create_future(), loop.create_future(), loop.create_future()
    trace: list[str] = []

    def steps() -> Steps:
        trace.append("first")
        yield (a, b)
        trace.append("second")
        yield (c,)
        trace.append("last")

    ended = _Ended()
    Stepper(steps(), ended).start()
    assert trace == ["first"]
    b.set_result(None)
    await asyncio.sleep(0)
    assert trace == ["first"]  # (a is still pending)
    a.set_result(None)
    await asyncio.sleep(0)
    assert trace == ["first", "second"] and not ended.calls
    c.set_result(None)
    await asyncio.sleep(0)
    assert trace == ["first", "second", "last"] and ended.calls == [None]


async def test_a_stepper_takes_steps_whose_futures_are_done_already_at_once() -> None:
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    done.set_result(None)

    def steps() -> Steps:
        for _ in range(3):
            yield (done, done)

    ended = _Ended()
    Stepper(steps(), ended).start()
    assert ended.calls == [None]  # synchronously: no loop turn between ready steps


async def test_a_stepper_ends_with_the_first_failure_and_takes_no_later_step() -> None:
    loop = asyncio.get_running_loop()
    a, b = loop.create_future(), loop.create_future()
    after: list[str] = []

    def steps() -> Steps:
        try:
            yield (a, b)
            after.append("ran")
        finally:
            after.append("closed")

    ended = _Ended()
    Stepper(steps(), ended).start()
    boom = ValueError("boom")
    a.set_exception(boom)
    b.set_exception(RuntimeError("later"))  # (retrieved: asyncio logs no lost exception)
    await asyncio.sleep(0)
    assert ended.calls == [boom] and after == ["closed"]


async def test_a_step_that_raises_ends_the_stepper_with_its_error() -> None:
    def steps() -> Steps:
        raise KeyError("bad")
        yield ()  # (a generator)

    ended = _Ended()
    Stepper(steps(), ended).start()
    assert len(ended.calls) == 1 and isinstance(ended.calls[0], KeyError)


async def test_a_stopped_stepper_takes_no_step_and_reports_nothing() -> None:
    loop = asyncio.get_running_loop()
    a = loop.create_future()
    trace: list[str] = []

    def steps() -> Steps:
        yield (a,)
        trace.append("second")

    ended = _Ended()
    stepper = Stepper(steps(), ended)
    stepper.start()
    stepper.stop()
    a.set_result(None)
    await asyncio.sleep(0)
    assert trace == [] and ended.calls == []


# -- the small collectives run as steps, through the group ------------------------------------


def _is_task(work: dist.Work) -> bool:
    return isinstance(_work.future_of(work), asyncio.Task)


@pytest.mark.parametrize("layout", ["flat", "one-host"])
@pytest.mark.parametrize("n", [2, 3, 4, 5])
async def test_small_collectives_run_as_steps_and_large_ones_as_tasks(n: int, layout: str) -> None:
    """Flat: barrier, recursive doubling, the binomial trees, Bruck's all_gather; one host sharing
    memory: the direct broadcast and all_gather. The large forms (rings, chains) run as tasks."""

    async def body(g: ProcessGroup) -> dict[str, Any]:
        r = g.rank
        x = np.full(5, r + 1, np.int64)
        b = np.full(3, r, np.int64)
        red = np.full(4, r + 1, np.int64)
        blocks = [np.zeros(2, np.int64) for _ in range(n)]
        big = np.ones(select.ALLREDUCE_RING_BYTES // 8, np.int64)
        works = {
            "all_reduce": dist.all_reduce(x, group=g),
            "barrier": dist.barrier(group=g),
            "broadcast": dist.broadcast(b, src=n - 1, group=g),
            "reduce": dist.reduce(red, dst=1, group=g),
            "all_gather": dist.all_gather(blocks, np.full(2, r * 7, np.int64), group=g),
            "ring": dist.all_reduce(big, group=g),
        }
        tasks = {name: _is_task(w) for name, w in works.items()}
        await asyncio.gather(*works.values())
        return {
            "tasks": tasks,
            "all_reduce": x.tolist(),
            "broadcast": b.tolist(),
            "reduce": red.tolist(),
            "all_gather": [blk.tolist() for blk in blocks],
            "ring": int(big[0]),
        }

    one_host = layout == "one-host"
    results = await run_memory_world(n, body, hosts=["h"] * n if one_host else None, shared_memory=one_host)
    stepped = {"all_reduce", "barrier", "broadcast", "reduce", "all_gather"}
    for r, res in enumerate(results):
        assert {name for name, task in res["tasks"].items() if not task} == stepped, (r, res["tasks"])
        assert res["all_reduce"] == [n * (n + 1) // 2] * 5
        assert res["broadcast"] == [n - 1] * 3
        if r == 1:
            assert res["reduce"] == [n * (n + 1) // 2] * 4
        assert res["all_gather"] == [[k * 7] * 2 for k in range(n)]
        assert res["ring"] == n


async def test_many_stepped_collectives_at_once_keep_their_order_on_every_rank() -> None:
    async def body(g: ProcessGroup) -> list[list[int]]:
        xs = [np.full(3, g.rank * 10 + i, np.int64) for i in range(20)]
        works = [dist.all_reduce(x, group=g) if i % 3 else dist.barrier(group=g) for i, x in enumerate(xs)]
        await asyncio.gather(*works)
        return [x.tolist() for i, x in enumerate(xs) if i % 3]

    n = 3
    results = await run_memory_world(n, body)
    expected = [[sum(r * 10 + i for r in range(n))] * 3 for i in range(20) if i % 3]
    assert all(r == expected for r in results)


async def test_a_stepped_all_reduce_that_disagrees_fails_on_both_ranks_and_resync_recovers() -> None:
    async with open_world(2, 5.0) as (_fabric, gs):
        a = dist.all_reduce(np.ones(4, np.float32), group=gs[0])
        b = dist.all_reduce(np.ones(4, np.float64), group=gs[1])
        for w in (a, b):
            with pytest.raises(dist.CollectiveMismatchError, match="all_reduce #0"):
                await w
        await asyncio.gather(*(dist.resync(g) for g in gs))
        xs = [np.full(2, r + 1, np.int64) for r in range(2)]
        await asyncio.gather(*(dist.all_reduce(x, group=g) for x, g in zip(xs, gs, strict=True)))
        assert [x.tolist() for x in xs] == [[3, 3], [3, 3]]


async def test_a_stepped_all_reduce_times_out_naming_the_missing_rank_and_resync_recovers() -> None:
    async with open_world(3, 0.3) as (_fabric, gs):
        works = [dist.all_reduce(np.ones(2, np.int64), group=g) for g in gs[:2]]  # rank 2 never comes
        for r, w in enumerate(works):
            with pytest.raises(dist.DistTimeoutError) as info:
                await w
            assert f"all_reduce #0 on rank {r} (default group) reached its timeout of 0.3 s" in str(
                info.value
            )
        assert "rank 2 never entered it" in str(info.value)
        reports = await asyncio.gather(*(dist.resync(g, timeout=5) for g in gs))
        assert all(r.next_op == 1 for r in reports)
        xs = [np.full(2, r + 1, np.int64) for r in range(3)]
        await asyncio.gather(*(dist.all_reduce(x, group=g) for x, g in zip(xs, gs, strict=True)))
        assert [x.tolist() for x in xs] == [[6, 6]] * 3


async def test_a_stepped_barrier_fails_naming_the_operation_when_a_member_is_lost() -> None:
    async with open_world(2, 5.0) as (fabric, gs):
        waiting = dist.barrier(group=gs[0])
        await asyncio.sleep(0.01)
        fabric.transports[1].abort()  # rank 1 is gone without entering the barrier
        with pytest.raises(dist.DistNetworkError, match=r"barrier #0 on rank 0") as info:
            await asyncio.wait_for(waiting, 10)
        assert "rank 1" in str(info.value)
        with pytest.raises(dist.DistNetworkError, match="broken"):
            dist.barrier(group=gs[0])
