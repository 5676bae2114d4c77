"""An operation declared in the operation table alone runs by name, with the checks, the
numbering and the fingerprints every operation has (``tests/support/declared.py``)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from support.declared import declare_test_operations

import aiodist as dist
from aiodist.group import ProcessGroup
from aiodist.testing import run_memory_world

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def _declared(monkeypatch: pytest.MonkeyPatch) -> None:
    declare_test_operations(monkeypatch)


async def test_an_operation_over_an_existing_kind_runs_by_name() -> None:
    async def rank(g: ProcessGroup) -> list[float]:
        t = np.full(3, float(g.rank + 1))
        await g.collective("sum_all", t)
        return t.tolist()

    assert await run_memory_world(3, rank) == [[6.0] * 3] * 3


async def test_an_operation_of_a_new_kind_runs_as_its_plan_says() -> None:
    async def rank(g: ProcessGroup) -> list[int]:
        out = np.zeros(2, np.int64)
        await g.collective("shift", out, np.full(2, 10 * g.rank, np.int64))
        # numbered like every other collective: the next operation of the group still agrees
        await g.collective("barrier")
        return out.tolist()

    assert await run_memory_world(4, rank) == [[30, 30], [0, 0], [10, 10], [20, 20]]


async def test_its_checks_refuse_before_anything_is_numbered() -> None:
    async def rank(g: ProcessGroup) -> str:
        with pytest.raises(dist.DistValueError, match="same dtype and size"):
            g.collective("shift", np.zeros(2), np.zeros(3))
        with pytest.raises(dist.DistValueError, match="no tensor collective is called 'nothing'"):
            g.collective("nothing")
        out = np.zeros(1)
        await g.collective("shift", out, np.full(1, float(g.rank)))  # the refusals took no number
        return str(out.tolist())

    assert await run_memory_world(2, rank) == ["[1.0]", "[0.0]"]


async def test_ranks_that_call_it_against_another_operation_get_a_mismatch() -> None:
    async def rank(g: ProcessGroup) -> str:
        t = np.zeros(2)
        work = g.collective("shift", t, np.ones(2)) if g.rank == 0 else g.collective("all_reduce", t)
        with pytest.raises(dist.CollectiveMismatchError) as caught:
            await asyncio.wait_for(work, 10)
        return str(caught.value)

    messages = await run_memory_world(2, rank, timeout=10)
    assert any("shift #" in m and "all_reduce #" in m for m in messages), messages


async def test_an_entry_whose_kind_is_not_declared_is_refused_at_the_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aiodist import operations
    from aiodist.backends.base import Op

    def orphan(g: object, b: object) -> operations.Checked:
        return operations.Checked(Op("nowhere"), "", 0)

    monkeypatch.setitem(operations.TABLE, "orphan", operations.Operation("orphan", orphan, "orphan", 0, None))

    async def rank(g: ProcessGroup) -> None:
        with pytest.raises(dist.DistValueError, match="'nowhere' is no kind of collective aiodist plans"):
            g.collective("orphan")
        await g.collective("barrier")  # its number was given back: the ranks still agree

    await run_memory_world(2, rank)
