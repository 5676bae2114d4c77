"""A Work dropped before anyone took its outcome is reported, as asyncio reports an un-awaited
coroutine and a task whose exception was never retrieved: a success with a RuntimeWarning, a
failure by logging its error. Whoever awaits or waits for a Work hears nothing.

Ranks as tasks over the in-memory transport (``run_memory_world``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import warnings
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import aiodist as dist
from aiodist.group import ProcessGroup
from aiodist.testing import run_memory_world

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def reports(caplog: pytest.LogCaptureFixture) -> Iterator[Callable[[], list[str]]]:
    """``reports()``: every RuntimeWarning and aiodist error log record of the test so far, as text
    (after a garbage collection, so that every dropped Work has been finalised)."""
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.ERROR):
        warnings.simplefilter("always")

        def found() -> list[str]:
            gc.collect()
            warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
            # (asyncio's own "Future exception was never retrieved" may come too, where a cycle
            # holding the Work is collected with its future; aiodist's report is what is checked)
            return warned + [r.getMessage() for r in caplog.records if r.name == "aiodist"]

        yield found


async def test_a_dropped_operation_that_succeeds_warns_naming_it(reports: Callable[[], list[str]]) -> None:
    async def fn(g: ProcessGroup) -> None:
        dist.all_reduce(np.ones(4, np.float32), group=g)  # started, its Work dropped at once
        await dist.barrier(group=g)  # (the all_reduce has completed once the barrier has)
        if g.rank == 0:
            done = dist.broadcast(np.ones(2), 0, group=g)
            await dist.barrier(group=g)
            del done  # dropped once completed, never looked at
        else:
            await dist.broadcast(np.ones(2), 0, group=g)
            await dist.barrier(group=g)

    await run_memory_world(2, fn)
    said = reports()
    never = [r for r in said if "was never awaited" in r]
    assert sum("all_reduce #0 was never awaited" in r for r in never) == 2, said  # both ranks
    assert sum("broadcast #2 was never awaited" in r for r in never) == 1, said
    assert "PYTHONASYNCIODEBUG=1" in never[0]  # how to find where it was started
    assert len(said) == 3, said


async def test_a_dropped_operation_that_fails_logs_its_error(reports: Callable[[], list[str]]) -> None:
    async def fn(g: ProcessGroup) -> None:
        if g.rank == 0:
            dist.recv(np.zeros(1), 1, group=g, timeout=0.02)  # nobody sends: it times out
            await asyncio.sleep(0.05)  # (the loop's timers run in order: the timeout comes first)
        await dist.barrier(group=g)

    await run_memory_world(2, fn)
    (report,) = reports()
    assert "the error of recv from rank 1 (tag 0) was never retrieved" in report, report
    # (asyncio says nothing of its own about the same error)


async def test_debug_mode_shows_where_the_operation_was_started(reports: Callable[[], list[str]]) -> None:
    asyncio.get_running_loop().set_debug(True)

    async def fn(g: ProcessGroup) -> None:
        dist.all_reduce(np.ones(4, np.float32), group=g)  # the line the report points at
        await dist.barrier(group=g)

    await run_memory_world(2, fn)
    said = reports()
    assert len(said) == 2, said
    assert "It was started at" in said[0] and "test_work_unseen.py" in said[0], said[0]
    assert "dist.all_reduce(np.ones(4, np.float32), group=g)  # the line" in said[0], said[0]


async def test_every_way_of_taking_the_outcome_is_silent(reports: Callable[[], list[str]]) -> None:
    """await, gather, wait from a thread, result/exception/is_success after completion,
    polling is_completed, get_future, a cancelled waiter, batch_isend_irecv: no report."""

    async def fn(g: ProcessGroup) -> None:
        t = np.ones(4, np.float32)
        await dist.all_reduce(t, group=g)
        await asyncio.gather(*(dist.all_reduce(t, group=g) for _ in range(3)))
        w = dist.all_reduce(t, group=g)
        await asyncio.to_thread(w.wait)
        w = dist.all_reduce(t, group=g)
        await dist.barrier(group=g)
        w.result()
        w = dist.all_reduce(t, group=g)
        while not w.is_completed():
            await asyncio.sleep(0)
        w = dist.all_reduce(t, group=g)
        await asyncio.wrap_future(w.get_future())
        w = dist.all_reduce(t, group=g)
        await dist.barrier(group=g)
        assert w.is_success() and w.exception() is None
        waiter = asyncio.ensure_future(_await(dist.all_reduce(t, group=g)))
        await asyncio.sleep(0)
        waiter.cancel()  # stops the waiting, not the operation (it was awaited)
        peer = 1 - g.rank
        ops = [dist.P2POp(dist.isend, t, peer, g), dist.P2POp(dist.irecv, np.zeros(4, np.float32), peer, g)]
        await asyncio.gather(*dist.batch_isend_irecv(ops))
        failed = dist.recv(np.zeros(1), peer, group=g, tag=9, timeout=0.02)
        with pytest.raises(dist.DistTimeoutError):
            await failed
        await dist.barrier(group=g)

    await run_memory_world(2, fn)
    assert reports() == []


async def test_a_failure_seen_only_as_completed_is_still_reported(reports: Callable[[], list[str]]) -> None:
    """is_completed() says the operation ended, not how: a failure it saw is still reported."""

    async def fn(g: ProcessGroup) -> None:
        if g.rank == 0:
            w = dist.recv(np.zeros(1), 1, group=g, timeout=0.02)
            while not w.is_completed():
                await asyncio.sleep(0.005)
            del w
        await dist.barrier(group=g)

    await run_memory_world(2, fn)
    (report,) = reports()
    assert "the error of recv from rank 1 (tag 0) was never retrieved" in report


async def test_asking_before_the_end_does_not_take_a_failure(reports: Callable[[], list[str]]) -> None:
    """exception(), is_success() or a wait() that times out while the operation runs, and a
    waiter that is cancelled, do not take its outcome: a failure that comes later is reported."""

    async def fn(g: ProcessGroup) -> None:
        if g.rank == 0:
            asked = dist.recv(np.zeros(1), 1, group=g, tag=1, timeout=0.02)
            assert asked.exception() is None and not asked.is_success()
            waited = dist.recv(np.zeros(1), 1, group=g, tag=2, timeout=0.02)
            with pytest.raises(dist.DistTimeoutError, match="still running"):
                await asyncio.to_thread(waited.wait, 0.001)
            cancelled = asyncio.ensure_future(_await(dist.recv(np.zeros(1), 1, group=g, tag=3, timeout=0.02)))
            await asyncio.sleep(0)
            cancelled.cancel()
            del asked, waited
            await asyncio.sleep(0.05)
        await dist.barrier(group=g)

    await run_memory_world(2, fn)
    said = reports()
    for tag in (1, 2, 3):
        assert sum(f"recv from rank 1 (tag {tag}) was never retrieved" in r for r in said) == 1, said
    assert len(said) == 3, said


async def _await(w: dist.Work) -> None:
    await w
