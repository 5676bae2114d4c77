"""The transport contract, asked of every transport alike: memory, TCP (connected at init or on
first use), shared memory.

What a group relies on of its transport (``aiodist.transport.base.Transport``), with real
sockets on 127.0.0.1 for TCP and real shared-memory rings between transports of this process
(each message size picks its shm path: inline records, records of up to 1 MiB, single-copy
reads or pieces above). A new transport is added to ``KINDS`` and must pass all of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from support.members import StubMember

from aiodist.errors import CollectiveMismatchError, DistNetworkError
from aiodist.transport.base import COLL, P2P, Transport
from aiodist.transport.memory import MemoryFabric
from aiodist.transport.shm_tcp import ShmTcpTransport
from aiodist.transport.tcp import TcpTransport
from aiodist.wire.control import GroupState, StateQuery

pytestmark = pytest.mark.timeout(60)

# "tcp-on-use": TCP whose peers are connected on first use (as ranks of different hosts are).
KINDS = ["memory", "tcp", "tcp-on-use", "shm"]
# Message sizes: empty, tiny, inline in a ring record, just over 64 KiB, just over 1 MiB, 4 MiB.
SIZES = [0, 1, 8, 1000, 65537, (1 << 20) + 1, 4 << 20]


async def _connected(kind: str, n: int) -> list[Transport]:
    if kind == "memory":
        return list(MemoryFabric(n).transports)
    cls = ShmTcpTransport if kind == "shm" else TcpTransport
    ts = [cls(r, n, job=f"conformance-{kind}", secret=b"conformance") for r in range(n)]
    ports = [await t.listen("127.0.0.1") for t in ts]
    if kind == "tcp-on-use":
        for t in ts:
            t.dial_on_use(lambda peer: ("127.0.0.1", ports[peer]))
        return list(ts)
    await asyncio.gather(
        *(ts[r].connect(p, "127.0.0.1", ports[p], 5.0) for r in range(n) for p in range(r)),
        *(ts[r].expect(p) for r in range(n) for p in range(r + 1, n)),
    )
    if isinstance(ts[0], ShmTcpTransport):
        await asyncio.gather(*(t.shm_settled() for t in ts if isinstance(t, ShmTcpTransport)))
    shared = [bool(t.local_peers()) for t in ts]
    assert shared == [kind == "shm"] * n, f"{kind}: shared memory between ranks is {shared}"
    return list(ts)


@pytest.fixture(params=KINDS)
async def world(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    """A factory of connected transports of the parametrised kind (closed after the test)."""
    monkeypatch.setenv("AIODIST_SHM", "1")
    made: list[Transport] = []

    async def make(n: int = 2) -> list[Transport]:
        ts = await _connected(request.param, n)
        made.extend(ts)
        return ts

    yield make
    for t in made:
        t.abort()


def _payload(n: int, seed: int) -> memoryview:
    return memoryview(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))


def _buffer(n: int) -> memoryview:
    return memoryview(np.zeros(n, np.uint8))


@pytest.mark.parametrize("nbytes", SIZES)
async def test_a_message_lands_whole_in_its_receive(world: Any, nbytes: int) -> None:
    a, b = await world()
    key = (0, P2P, 5)
    sent = _payload(nbytes, nbytes)
    got = _buffer(nbytes)
    fut = b.recv(0, key, got)
    await asyncio.wait_for(asyncio.gather(a.send(1, key, sent), fut), 20)
    assert fut.result() == 0  # the sender's rank
    assert bytes(got) == bytes(sent)


@pytest.mark.parametrize("nbytes", [8, 65537, (1 << 20) + 1])
async def test_a_message_sent_before_its_receive_waits_for_it(world: Any, nbytes: int) -> None:
    a, b = await world()
    key = (0, COLL, 3)
    sent = _payload(nbytes, 7)
    sending = asyncio.ensure_future(a.send(1, key, sent))
    await asyncio.sleep(0.2)
    got = _buffer(nbytes)
    assert await asyncio.wait_for(b.recv(0, key, got), 20) == 0
    await asyncio.wait_for(sending, 20)
    assert bytes(got) == bytes(sent)


async def test_a_receive_from_any_source_names_the_sender(world: Any) -> None:
    r0, r1, r2 = await world(3)
    key = (0, P2P, 1)
    bufs = [_buffer(4), _buffer(4)]
    futs = [r0.recv(None, key, buf) for buf in bufs]
    await asyncio.wait_for(
        asyncio.gather(r1.send(0, key, memoryview(b"one!")), r2.send(0, key, memoryview(b"two!")), *futs), 20
    )
    got = {f.result(): bytes(buf) for f, buf in zip(futs, bufs, strict=True)}
    assert got == {1: b"one!", 2: b"two!"}


async def test_messages_of_one_sender_and_key_arrive_in_send_order(world: Any) -> None:
    a, b = await world()
    key = (0, P2P, 9)
    sizes = [8, 70000, 8, (1 << 20) + 8, 8, 0, 16]  # ring records, single-copy reads, inline
    sent = [_payload(n, i) for i, n in enumerate(sizes)]
    sends = [a.send(1, key, p) for p in sent]
    got = [_buffer(n) for n in sizes]
    for buf in got:
        await asyncio.wait_for(b.recv(0, key, buf), 20)
    await asyncio.wait_for(asyncio.gather(*sends), 20)
    assert [bytes(g) for g in got] == [bytes(s) for s in sent]


async def test_keys_keep_messages_apart(world: Any) -> None:
    a, b = await world()
    first, second = (0, COLL, 1), (0, COLL, 2)
    sends = [a.send(1, second, memoryview(b"second")), a.send(1, first, memoryview(b"first!"))]
    got_first, got_second = _buffer(6), _buffer(6)
    await asyncio.wait_for(b.recv(0, first, got_first), 20)
    await asyncio.wait_for(b.recv(0, second, got_second), 20)
    await asyncio.gather(*sends)
    assert (bytes(got_first), bytes(got_second)) == (b"first!", b"second")


async def test_a_withdrawn_receive_gets_nothing_and_the_next_one_gets_the_message(world: Any) -> None:
    a, b = await world()
    key = (0, P2P, 4)
    old = _buffer(8)
    withdrawn = b.recv(0, key, old)
    b.cancel_recv(withdrawn)
    await a.send(1, key, memoryview(b"12345678"))
    await asyncio.sleep(0.1)
    new = _buffer(8)
    assert await asyncio.wait_for(b.recv(0, key, new), 20) == 0
    assert bytes(new) == b"12345678" and bytes(old) == bytes(8)


async def test_a_message_of_another_size_than_its_receive_is_refused(world: Any) -> None:
    a, b = await world()
    key = (0, P2P, 2)
    fut = b.recv(0, key, _buffer(8))
    await a.send(1, key, memoryview(bytes(16)))
    with pytest.raises(CollectiveMismatchError, match=r"rank 0 sent 16 bytes .* a buffer of 8 bytes"):
        await asyncio.wait_for(fut, 20)


async def test_a_control_message_reaches_its_groups_handler(world: Any) -> None:
    a, b = await world()
    seen: list[tuple[int, Any]] = []
    arrived = asyncio.get_running_loop().create_future()

    def handler(src: int, msg: Any) -> None:
        seen.append((src, msg))
        if not arrived.done():
            arrived.set_result(None)

    query = StateQuery(7, 1, 3, "all_reduce #3", GroupState(4, 0, 0, ()))
    a.send_control(1, query)  # (before its group exists on rank 1: kept for it)
    await asyncio.sleep(0.1)
    b.attach(7, StubMember(on_control=handler))
    await asyncio.wait_for(arrived, 20)
    assert seen == [(0, query)]


async def test_a_crashed_peer_fails_the_receives_waiting_on_it(world: Any) -> None:
    a, b = await world()
    waiting = b.recv(0, (0, P2P, 1), _buffer(8))
    lost: list[int] = []
    b.attach(0, StubMember(on_peer_lost=lambda peer, exc: lost.append(peer)))
    a.abort()
    with pytest.raises(DistNetworkError, match="rank 0"):
        await asyncio.wait_for(waiting, 10)
    assert lost == [0]
    with pytest.raises(DistNetworkError, match="rank 0"):  # and a send to it says so at once
        b.send(0, (0, P2P, 2), _payload(8, 0))
