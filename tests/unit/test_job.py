"""A job closes once: its views' teardowns (newest first), then its connections, then its store."""

from __future__ import annotations

import pytest

from aiodist.errors import DistStoreError
from aiodist.job import Job, open_jobs
from aiodist.store.memory import HashStore
from aiodist.transport.memory import MemoryFabric

pytestmark = pytest.mark.timeout(20)


async def test_close_runs_the_views_newest_first_then_the_connections_then_the_store() -> None:
    fabric = MemoryFabric(2)
    store = HashStore()
    job = Job(fabric.transports[0], store)
    assert job in open_jobs()
    seen: list[tuple[str, str, bool]] = []

    def world_view(reason: str) -> None:
        seen.append(("world", reason, job.transport.closed))

    async def torch_view(reason: str) -> None:
        seen.append(("torch", reason, job.transport.closed))

    job.on_close(world_view)
    job.on_close(torch_view)
    await job.close("the process group was destroyed")
    # Each view still had the connections (to fail its groups' operations in order).
    assert seen == [
        ("torch", "the process group was destroyed", False),
        ("world", "the process group was destroyed", False),
    ]
    assert job.transport.closed and job.closed and job not in open_jobs()
    with pytest.raises(DistStoreError, match="closed"):
        await store.get("anything")
    await job.close("again")  # closing a closed job does nothing
    assert len(seen) == 2


async def test_a_forgotten_view_is_not_torn_down_and_a_failing_one_still_closes_the_connections() -> None:
    fabric = MemoryFabric(2)
    job = Job(fabric.transports[0])
    calls: list[str] = []

    def gone(reason: str) -> None:
        calls.append("gone")

    def broken(reason: str) -> None:
        raise RuntimeError("teardown failed")

    job.on_close(broken)
    job.on_close(gone)
    job.forget(gone)  # its view closed on its own
    with pytest.raises(RuntimeError, match="teardown failed"):
        await job.close("the process is exiting")
    assert calls == [] and job.transport.closed and job not in open_jobs()


async def test_group_ids_count_up_from_the_default_groups() -> None:
    job = Job(MemoryFabric(1).transports[0])
    try:
        assert [job.next_gid() for _ in range(3)] == [1, 2, 3]
    finally:
        await job.close("done")
