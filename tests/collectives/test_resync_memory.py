"""The state exchange after a timeout and ``resync``, step by step on the in-memory transport
(deterministic orderings the process tests reach only by chance)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from support.members import StubMember
from support.worlds import open_world

import aiodist as dist
from aiodist.group import ProcessGroup

pytestmark = pytest.mark.timeout(30)


async def _exact_all_reduce(gs: list[ProcessGroup]) -> None:
    """The group is usable again: an all_reduce on every rank gives the exact sum."""
    xs = [np.full(3, r + 1, np.int64) for r in range(len(gs))]
    await asyncio.gather(*(dist.all_reduce(x, group=g) for x, g in zip(xs, gs, strict=True)))
    total = sum(range(1, len(gs) + 1))
    assert all(x.tolist() == [total] * 3 for x in xs)


async def test_a_rank_that_completed_what_the_root_abandoned_is_stopped_and_resync_reports_it() -> None:
    async with open_world(3, 0.3) as (_fabric, gs):
        # gather #0 to rank 0: rank 1 sends its part and is done; rank 2 never comes.
        root = dist.gather(np.zeros(2, np.int64), [np.zeros(2, np.int64) for _ in range(3)], 0, group=gs[0])
        await dist.gather(np.ones(2, np.int64), dst=0, group=gs[1])  # completes on rank 1
        with pytest.raises(dist.DistTimeoutError) as info:
            await root
        msg = str(info.value)
        assert msg.startswith(
            "gather #0 on rank 0 (default group) reached its timeout of 0.3 s waiting for data from rank 2"
        )
        assert "rank 2 never entered it (it has started no operation on the group yet)" in msg, msg
        assert "rank 1 had completed it" in msg and "out of step" in msg, msg
        # rank 1 never saw an error: the root's query stops its next collective at once
        for g in gs[1:]:
            with pytest.raises(dist.GroupOutOfStepError, match="call resync"):
                await dist.all_reduce(np.ones(2, np.int64), group=g)
        reports = await asyncio.gather(*(dist.resync(g) for g in gs))
        for r in reports:
            assert r.next_op == 1 and r.ranks_at == {0: 1, 1: 1, 2: 0}
            assert r.completed == {0: (1,)} and r.disagreed == (0,)
        assert "operation #0 completed only on rank 1" in str(reports[0])
        await _exact_all_reduce(gs)


async def test_a_slow_rank_that_entered_gives_up_with_the_others_and_the_group_stays_in_step() -> None:
    async with open_world(3, 0.3) as (fabric, gs):
        # everybody enters all_reduce #0, rank 2 with no timeout of its own: the others' limit
        # is what ends it, on rank 2 too, and the group goes on in step.
        mailbox = fabric.transports[2].mailbox
        deliver = mailbox.deliver
        mailbox.deliver = lambda *args, **kwargs: None  # type: ignore[method-assign]  # rank 2 reads nothing
        big = 1 << 18  # 2 MiB: the ring, in which every rank forwards what it received
        works = [dist.all_reduce(np.ones(big, np.int64), group=g) for g in gs[:2]]
        slow = dist.all_reduce(np.ones(big, np.int64), group=gs[2], timeout=60)
        for w in works:
            with pytest.raises(dist.DistTimeoutError, match="every rank entered it"):
                await w
        with pytest.raises(dist.DistTimeoutError, match="reached its time limit in it first") as info:
            await slow
        assert "out of step" not in str(info.value)
        assert all(g.out_of_step is None for g in gs)
        mailbox.deliver = deliver  # type: ignore[method-assign]
        await _exact_all_reduce(gs)


async def test_resync_alone_times_out_and_can_be_called_again() -> None:
    async with open_world(2, 5) as (_fabric, gs):
        with pytest.raises(dist.DistTimeoutError, match=r"resync #1 on rank 0 .* rank 1 did not call resync"):
            await dist.resync(gs[0], timeout=0.2)
        # rank 1 was told: its collectives refuse until it resyncs too
        with pytest.raises(dist.GroupOutOfStepError, match="rank 0 called resync #1"):
            await dist.all_reduce(np.ones(1), group=gs[1])
        reports = await asyncio.gather(dist.resync(gs[0]), dist.resync(gs[1]))
        assert [r.resync for r in reports] == [1, 1] and [r.next_op for r in reports] == [0, 0]


async def test_resync_refuses_a_group_that_lost_a_member() -> None:
    async with open_world(2, 5) as (fabric, gs):
        fabric.kill(1)
        with pytest.raises(dist.DistNetworkError, match="destroy the process group and init again"):
            await dist.resync(gs[0])


async def test_a_resync_proposal_that_overtakes_the_group_waits_for_it() -> None:
    """A member's proposal for a group this rank has not created yet is handed to the group when
    it is created (in arrival order), not dropped: resync right after new_group completes."""
    async with open_world(2, 5.0) as (fabric, _gs):
        t0, t1 = fabric.transports
        early = ProcessGroup(t0, [0, 1], 7, timeout=5.0)
        proposal = early.resync()  # rank 1 has no group 7 yet
        await asyncio.sleep(0.01)  # (the memory transport delivers on the next turn)
        late = ProcessGroup(t1, [0, 1], 7, timeout=5.0)
        reports = await asyncio.gather(proposal, late.resync())
        assert [r.next_op for r in reports] == [0, 0]
        await _exact_all_reduce([early, late])


async def test_control_of_a_destroyed_group_is_dropped_and_early_control_is_bounded() -> None:
    async with open_world(2, 5.0) as (fabric, _gs):
        t1 = fabric.transports[1]
        seen: list[object] = []
        g = ProcessGroup(t1, [0, 1], 9, timeout=5.0)
        g.abort()  # gone: its control messages are dropped, not kept for a later group
        t1._control_received(0, _proposal(9))
        assert 9 not in t1._control_early
        for gid in range(100, 300):  # a peer (or a stranger with the secret) far ahead: bounded
            t1._control_received(0, _proposal(gid))
        assert len(t1._control_early) <= 64
        t1.attach(100, StubMember(on_control=lambda src, msg: seen.append((src, msg.gid))))
        assert seen == [(0, 100)]


def _proposal(gid: int) -> object:
    from aiodist.wire.control import GroupState, ResyncProposal

    return ResyncProposal(gid, 1, GroupState(0, 0, 0, ()))


async def test_a_late_message_stops_the_group_until_resync_and_says_so() -> None:
    """Both ranks believe they are the broadcast's root: each completes, then receives the
    other's data late. The group refuses later collectives saying what repairs it (resync, not
    destroy and init), and resync does."""
    async with open_world(2, 5.0) as (_fabric, gs):
        await asyncio.gather(
            dist.broadcast(np.ones(4), 0, group=gs[0]),
            dist.broadcast(np.ones(4), 1, group=gs[1]),
            return_exceptions=True,  # (one, or both, may see the other's data in time)
        )
        await asyncio.sleep(0.05)  # (the late messages arrive)
        for g in gs:
            with pytest.raises(dist.CollectiveMismatchError) as info:
                await dist.all_reduce(np.ones(2), group=g)
            text = str(info.value)
            assert "cannot go on until resync on every rank" in text and "is broken" not in text, text
        await asyncio.gather(*(dist.resync(g) for g in gs))
        await _exact_all_reduce(gs)
