"""Several tasks per rank starting collectives on one group, over the in-memory transport.

Collectives on a group are matched across ranks by call order; tasks whose operations are
started in different orders on different ranks must never exchange each other's data: every
operation either returns the right result or raises ``CollectiveMismatchError`` (its
fingerprint names the task that started it). With one group per task, any order is right.
"""

from __future__ import annotations

import pytest
from support.task_order import OPS, run_tasks, schedule

from aiodist.group import ProcessGroup
from aiodist.testing import run_memory_world

pytestmark = pytest.mark.timeout(120)


def _kinds(outcomes: list[list[tuple[str, str]]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for per_rank in outcomes:
        for kind, _ in per_rank:
            counts[kind] = counts.get(kind, 0) + 1
    return counts


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize(("size", "tasks"), [(2, 2), (3, 3), (3, 2)])
async def test_tasks_in_different_orders_get_the_right_result_or_a_mismatch(
    op: str, size: int, tasks: int
) -> None:
    async def rank(g: ProcessGroup) -> list[tuple[str, str]]:
        return await run_tasks([g] * tasks, g.rank, size, op, schedule("random", seed=size), rounds=12)

    outcomes = await run_memory_world(size, rank)
    wrong = [d for per_rank in outcomes for kind, d in per_rank if kind in ("wrong", "error")]
    assert not wrong, wrong[:3]
    kinds = _kinds(outcomes)
    assert kinds.get("mismatch", 0) > 0, "the orders differ across ranks: some pairs must disagree"
    assert kinds.get("ok", 0) > 0, "rounds whose orders agree complete"
    for per_rank in outcomes:
        for kind, detail in per_rank:
            if kind == "mismatch" and "from task" in detail:
                assert "rank/run_tasks.task[" in detail  # names the tasks, as each rank calls them
                assert "give each task its own group" in detail


@pytest.mark.parametrize("op", ["all_reduce", "broadcast", "all_gather_into_tensor"])
async def test_tasks_in_one_order_on_every_rank_all_succeed(op: str) -> None:
    async def rank(g: ProcessGroup) -> list[tuple[str, str]]:
        return await run_tasks([g] * 3, g.rank, 3, op, schedule("aligned"), rounds=10)

    outcomes = await run_memory_world(3, rank)
    assert _kinds(outcomes) == {"ok": 3 * 3 * 10}


@pytest.mark.parametrize("op", sorted(OPS))
async def test_one_group_per_task_is_right_in_any_order(op: str) -> None:
    async def rank(g: ProcessGroup) -> list[tuple[str, str]]:
        groups = [ProcessGroup(g.transport, g.ranks, 10 + k, timeout=30) for k in range(3)]
        return await run_tasks(groups, g.rank, 3, op, schedule("random", seed=7), rounds=8)

    outcomes = await run_memory_world(3, rank)
    assert _kinds(outcomes) == {"ok": 3 * 3 * 8}


async def _roles(g: ProcessGroup, check: str) -> list[float]:
    """A learner (rank 0) publishing weights to actors: rank 0 runs coroutine ``publish``, the
    others ``listen``, each task alone on its group (one shared by all, one per actor), in one
    fixed order: correct under torch, whatever the tasks are called."""
    import asyncio

    import numpy as np

    import aiodist as dist

    shared = ProcessGroup(g.transport, g.ranks, 20, timeout=30, task_check=check)
    own = [ProcessGroup(g.transport, [0, a], 21 + a, timeout=30, task_check=check) for a in g.ranks[1:]]
    got: list[float] = []

    async def publish() -> None:
        for step in range(3):
            w = np.full(4, float(step))
            await dist.broadcast(w, 0, group=shared)
            for sub in own:
                await dist.broadcast(w + 100, 0, group=sub)

    async def listen() -> None:
        sub = next(s for s in own if s.is_member())
        for _ in range(3):
            w = np.zeros(4)
            await dist.broadcast(w, 0, group=shared)
            got.append(float(w[0]))
            await dist.broadcast(w, 0, group=sub)
            got.append(float(w[0]))

    await asyncio.create_task(publish() if g.rank == 0 else listen())
    return got


async def test_ranks_running_different_tasks_in_a_fixed_order_run_as_under_torch() -> None:
    """Different coroutines per rank (roles) are no race: task_check "auto" lets them run."""
    results = await run_memory_world(3, lambda g: _roles(g, "auto"))
    actor = [0.0, 100.0, 1.0, 101.0, 2.0, 102.0]
    assert results == [[], actor, actor]


async def test_strict_task_check_refuses_differently_named_tasks() -> None:
    import aiodist as dist

    with pytest.raises(
        dist.CollectiveMismatchError,
        match=r"from task rank/_roles\.listen\[0\] but rank 0 sent .* from task rank/_roles\.publish\[0\]",
    ):
        await run_memory_world(3, lambda g: _roles(g, "strict"), timeout=10)


async def _actors(g: ProcessGroup, check: str) -> list[float]:
    """Rank 0 starts one task of coroutine ``actor`` per other rank, each on a group of its own
    with that rank; every other rank starts one: rank k's ``actor[0]`` pairs with rank 0's
    ``actor[k-1]`` (tasks of one coroutine counted differently on each rank)."""
    import asyncio

    import numpy as np

    import aiodist as dist

    own = [ProcessGroup(g.transport, [0, a], 40 + a, timeout=30, task_check=check) for a in g.ranks[1:]]

    async def actor(sub: ProcessGroup) -> float:
        x = np.full(2, float(g.rank))
        await dist.all_reduce(x, group=sub)
        return float(x[0])

    if g.rank == 0:
        return list(await asyncio.gather(*(asyncio.create_task(actor(s)) for s in own)))
    return [await asyncio.create_task(actor(next(s for s in own if s.is_member())))]


async def test_task_check_off_lets_tasks_of_one_coroutine_pair_across_counts() -> None:
    """Tasks of one coroutine whose counts differ across ranks look like siblings racing to
    "auto" (documented); a group made with task_check="off" pairs them by call order alone."""
    import aiodist as dist

    with pytest.raises(dist.CollectiveMismatchError, match="give each task its own group"):
        await run_memory_world(3, lambda g: _actors(g, "auto"), timeout=10)
    assert await run_memory_world(3, lambda g: _actors(g, "off")) == [[1.0, 2.0], [1.0], [2.0]]


@pytest.mark.parametrize("op", ["all_reduce", "broadcast"])
async def test_task_check_off_matches_by_call_order_alone(op: str) -> None:
    """ "off": torch's behaviour, racing tasks included (the check is the user's to waive)."""

    async def rank(g: ProcessGroup) -> list[tuple[str, str]]:
        off = ProcessGroup(g.transport, g.ranks, 60, timeout=30, task_check="off")
        return await run_tasks([off] * 2, g.rank, 2, op, schedule("rotated"), rounds=4)

    kinds = _kinds(await run_memory_world(2, rank))
    assert "mismatch" not in kinds and kinds.get("wrong", 0) > 0, kinds
