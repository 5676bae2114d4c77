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
