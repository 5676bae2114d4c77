"""Point-to-point and Work semantics over the in-memory transport (ranks as tasks)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable

import numpy as np
import pytest

from aiodist import CollectiveMismatchError, DistTimeoutError, DistValueError
from aiodist.group import ProcessGroup
from aiodist.testing import memory_world, run_memory_world
from aiodist.transport.base import Fingerprint, Key
from aiodist.transport.memory import MemoryFabric


async def test_send_recv_tags_and_any_source() -> None:
    async def fn(g: ProcessGroup) -> object:
        if g.rank == 0:
            a = np.arange(10, dtype=np.float32)
            await g.send(a, 3, tag=0)
            await g.send(a * 2, 3, tag=7)
            return None
        if g.rank == 3:
            tagged = np.zeros(10, np.float32)
            plain = np.zeros(10, np.float32)
            w7 = g.recv(tagged, 0, tag=7)  # posted first, but only tag 7 matches it
            src = await g.recv(plain, None)
            await w7
            return src, plain.tolist(), tagged.tolist()
        return None

    res = await run_memory_world(4, fn)
    src, plain, tagged = res[3]  # type: ignore[misc]
    assert src == 0
    assert plain == list(range(10))
    assert tagged == [2 * i for i in range(10)]


async def test_any_source_returns_each_sender() -> None:
    async def fn(g: ProcessGroup) -> object:
        if g.rank == 0:
            seen = []
            for _ in range(g.size - 1):
                buf = np.zeros(1, np.int64)
                src = await g.recv(buf)
                assert buf[0] == src * 100
                seen.append(src)
            return sorted(seen)
        await g.send(np.array([g.rank * 100], np.int64), 0)
        return None

    assert (await run_memory_world(5, fn))[0] == [1, 2, 3, 4]


async def test_non_overtaking_many_in_flight() -> None:
    n = 200

    async def fn(g: ProcessGroup) -> object:
        if g.rank == 0:
            works = [g.send(np.full(3, i, np.int32), 1) for i in range(n)]
            await asyncio.gather(*works)
            return None
        bufs = [np.zeros(3, np.int32) for _ in range(n)]
        works = [g.recv(b, 0) for b in bufs]  # all posted at once
        await asyncio.gather(*works)
        return [int(b[0]) for b in bufs]

    assert (await run_memory_world(2, fn))[1] == list(range(n))


async def test_messages_arriving_before_the_receive_are_held() -> None:
    async def fn(g: ProcessGroup) -> object:
        if g.rank == 0:
            for i in range(5):
                await g.send(np.full(2, i, np.float64), 1, tag=i)
            return None
        await asyncio.sleep(0.05)
        out = []
        for i in reversed(range(5)):
            b = np.zeros(2)
            await g.recv(b, 0, tag=i)
            out.append(b[0])
        return out

    assert (await run_memory_world(2, fn))[1] == [4, 3, 2, 1, 0]


async def test_size_and_dtype_mismatch_raise() -> None:
    async def fn(g: ProcessGroup) -> object:
        if g.rank == 0:
            await g.send(np.zeros(10, np.float32), 1)
            await g.send(np.zeros(4, np.float32), 1, tag=1)
            return None
        with pytest.raises(CollectiveMismatchError, match="rank 0"):
            await g.recv(np.zeros(20, np.float32), 0)
        with pytest.raises(CollectiveMismatchError, match="float32"):
            await g.recv(np.zeros(4, np.int32), 0, tag=1)
        return "ok"

    assert (await run_memory_world(2, fn))[1] == "ok"


async def test_a_refused_message_fails_its_completed_send_at_the_next_send_with_that_tag() -> None:
    """A small send completes once queued; when the receiver then refuses its message (a
    receive of another size), the next send to that receiver with that tag raises the
    refusal, naming both ranks and both sizes, without sending anything; then the tag works
    again. Other tags, and receives, are not touched."""

    async def fn(g: ProcessGroup) -> object:
        if g.rank == 0:
            await g.send(np.ones(4, np.float32), 1)  # completes: its message is refused later
            await g.collective("barrier")  # (the receiver has refused it by now)
            await g.send(np.ones(2, np.int64), 1, tag=5)  # another tag: goes on
            with pytest.raises(CollectiveMismatchError) as refused:
                g.send(np.full(3, 7, np.float32), 1)
            await g.send(np.full(3, 9, np.float32), 1)  # raised once: the tag works again
            return str(refused.value)
        with pytest.raises(CollectiveMismatchError, match="rank 0 sent send of 4 x float32"):
            await g.recv(np.zeros(8, np.float32), 0)
        await g.collective("barrier")
        other = np.zeros(2, np.int64)
        await g.recv(other, 0, tag=5)
        got = np.zeros(3, np.float32)
        await g.recv(got, 0)
        return other.tolist(), got.tolist()

    said, received = await run_memory_world(2, fn)
    assert received == ([1, 1], [9.0, 9.0, 9.0])  # the refused send sent nothing
    assert "send to rank 1 (tag 0) on rank 0 was not started" in said, said
    assert "rank 1 expected send of 8 x float32 but rank 0 sent send of 4 x float32" in said, said


def _pending_sends(fabric: MemoryFabric, monkeypatch: pytest.MonkeyPatch) -> list[asyncio.Future[None]]:
    """Make rank 0's sends stay pending (as a large one draining into a socket does) until the
    test completes them; returns their futures, in order."""
    pending: list[asyncio.Future[None]] = []
    t0 = fabric.transports[0]
    send = t0.send

    def held_send(dst: int, key: Key, payload: memoryview, fp: Fingerprint | None = None) -> Awaitable[None]:
        send(dst, key, payload, fp)
        fut: asyncio.Future[None] = t0.loop.create_future()
        pending.append(fut)
        return fut

    monkeypatch.setattr(t0, "send", held_send)
    return pending


async def test_a_refused_message_fails_its_pending_send(monkeypatch: pytest.MonkeyPatch) -> None:
    """A send still pending when its receiver refuses the message fails with the refusal;
    another pending send to the same rank and tag, whose message was accepted, completes."""
    fabric, (g0, g1) = memory_world(2)
    pending = _pending_sends(fabric, monkeypatch)
    ok = g0.send(np.ones(4, np.float32), 1)
    bad = g0.send(np.ones(6, np.float32), 1)
    first = np.zeros(4, np.float32)
    await g1.recv(first, 0)
    with pytest.raises(CollectiveMismatchError, match="rank 0 sent send of 6 x float32"):
        await g1.recv(np.zeros(8, np.float32), 0)
    with pytest.raises(CollectiveMismatchError) as refused:
        await bad
    said = str(refused.value)
    assert said.startswith("send to rank 1 (tag 0) on rank 0: the receiver refused the message"), said
    assert "rank 1 expected send of 8 x float32 but rank 0 sent send of 6 x float32" in said, said
    assert not ok.is_completed()
    for fut in pending:
        if not fut.done():
            fut.set_result(None)
    await ok  # accepted: it completes as usual
    assert first.tolist() == [1.0] * 4
    monkeypatch.undo()
    x = np.zeros(2)
    w = g1.recv(x, 0)
    await g0.send(np.ones(2), 1)  # nothing is left over for the next send
    await w


async def test_misuse_is_a_clear_error() -> None:
    _fabric, groups = memory_world(2)
    g = groups[0]
    with pytest.raises(DistValueError, match="dst=5"):
        g.send(np.zeros(1), 5)
    with pytest.raises(DistValueError, match="own rank"):
        g.send(np.zeros(1), 0)
    with pytest.raises(TypeError, match="tag"):
        g.send(np.zeros(1), 1, tag="x")  # type: ignore[arg-type]
    for tag in (2**64, 2**63, -(2**63) - 1):  # beyond what a message header carries: both sides
        with pytest.raises(ValueError, match="signed 64-bit"):
            g.send(np.zeros(1), 1, tag=tag)
        with pytest.raises(ValueError, match="signed 64-bit"):
            g.recv(np.zeros(1), 1, tag=tag)
    for tag in (2**63 - 1, -(2**63)):  # the ends of the range travel
        w = g.send(np.ones(1), 1, tag=tag)
        buf = np.zeros(1)
        await groups[1].recv(buf, 0, tag=tag)
        await w
        assert buf[0] == 1
    with pytest.raises(ValueError, match="tensor"):
        g.recv(np.zeros((4, 4))[:, 0], 1)  # not contiguous
    ro = np.zeros(3)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="tensor"):
        g.recv(ro, 1)


async def test_recv_timeout_does_not_poison_the_group() -> None:
    _fabric, groups = memory_world(2, timeout=0.2)
    g0, g1 = groups
    buf = np.zeros(1)
    with pytest.raises(DistTimeoutError, match="rank 0"):
        await g1.recv(buf, 0)
    # the same pair and tag still work afterwards, and the late message goes to the new receive
    await g0.send(np.ones(1), 1)
    assert await g1.recv(buf, 0) == 0 and buf[0] == 1


async def test_work_semantics() -> None:
    _fabric, (g0, g1) = memory_world(2)
    buf = np.zeros(4)
    work = g1.recv(buf, 0)
    assert not work.is_completed() and work.exception() is None
    # a thread can wait() while the loop runs
    result: list[object] = []
    t = threading.Thread(target=lambda: result.append(work.wait(timeout=5)))
    t.start()
    await asyncio.sleep(0.01)
    await g0.send(np.arange(4.0), 1)
    assert await work == 0
    await asyncio.to_thread(t.join, 5)
    assert result == [True]
    assert work.is_completed() and work.is_success() and work.result() == 0
    assert buf.tolist() == [0, 1, 2, 3]
    assert work.get_future().result(1) == 0


async def test_failed_work_reraises_everywhere() -> None:
    _fabric, (g0, g1) = memory_world(2)
    work = g1.recv(np.zeros(3, np.float32), 0)
    await g0.send(np.zeros(5, np.float32), 1)
    with pytest.raises(CollectiveMismatchError):
        await work
    assert work.is_completed() and not work.is_success()
    assert isinstance(work.exception(), CollectiveMismatchError)
    with pytest.raises(CollectiveMismatchError):
        work.result()
    with pytest.raises(CollectiveMismatchError):
        await asyncio.to_thread(work.wait)


async def test_wait_timeout_leaves_operation_running() -> None:
    _fabric, (g0, g1) = memory_world(2)
    buf = np.zeros(1)
    work = g1.recv(buf, 0)
    with pytest.raises(DistTimeoutError, match="still running"):
        await asyncio.to_thread(work.wait, 0.05)
    await g0.send(np.ones(1), 1)
    assert await work == 0 and buf[0] == 1


async def test_cancelling_the_awaiting_task_keeps_the_operation() -> None:
    _fabric, (g0, g1) = memory_world(2)
    buf = np.zeros(1)
    work = g1.recv(buf, 0)
    waiter = asyncio.ensure_future(_await(work))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not work.is_completed()
    await g0.send(np.full(1, 7.0), 1)
    assert await work == 0 and buf[0] == 7


async def _await(work: object) -> object:
    return await work  # type: ignore[misc]


async def test_lost_peer_fails_pending_and_later_operations() -> None:
    fabric, groups = memory_world(3)
    work = groups[0].recv(np.zeros(1), 2)
    fabric.kill(2)
    with pytest.raises(Exception, match="rank 2"):
        await work
    with pytest.raises(Exception, match="broken"):
        groups[0].send(np.zeros(1), 1)


async def test_barrier_all_sizes() -> None:
    for n in range(1, 8):
        order: list[int] = []

        async def fn(g: ProcessGroup, order: list[int] = order) -> None:
            await asyncio.sleep(0.001 * g.rank)
            order.append(g.rank)
            await g.collective("barrier")
            assert len(order) == g.size  # nobody leaves before everybody arrived

        await run_memory_world(n, fn)


async def test_orderly_leave_does_not_break_the_others() -> None:
    """A rank that destroys its group (torch's tutorial: ranks 1, 2 leave at once) leaves the
    other ranks free to go on among themselves; only what needs the leaver fails."""
    fabric, groups = memory_world(3)
    await fabric.transports[1].aclose()
    buf = np.zeros(2)
    w = groups[2].recv(buf, 0)
    await groups[0].send(np.ones(2), 2)
    assert await w == 0 and buf.tolist() == [1.0, 1.0]
    with pytest.raises(Exception, match="rank 1 has left"):
        await groups[0].recv(np.zeros(1), 1)
