"""Peers connected on first use: what a job of many hosts relies on of its connections.

Real sockets on 127.0.0.1, every rank a transport on this test's loop. A job connects the
ranks of one host at init and the ranks of other hosts when an operation first needs them
(``TcpTransport.dial_on_use``): messages sent meanwhile wait in order, two ranks that dial
each other at once keep one connection and lose nothing, and a peer that is gone by then
fails what needs it, naming it, at once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
from support.members import StubMember

from aiodist.errors import DistNetworkError
from aiodist.runtime import host as _host
from aiodist.settings import Settings
from aiodist.store.memory import HashStore
from aiodist.transport.base import P2P
from aiodist.transport.mesh import claim_rank, connect_mesh
from aiodist.transport.tcp import TcpTransport
from aiodist.wire.control import GroupState, StateQuery

pytestmark = pytest.mark.timeout(60)


async def _unconnected(n: int) -> list[TcpTransport]:
    """``n`` transports that know where the others listen and have connected to nobody."""
    ts = [TcpTransport(r, n, job="dial-on-use", secret=b"s") for r in range(n)]
    ports = [await t.listen("127.0.0.1") for t in ts]
    for t in ts:
        t.dial_on_use(lambda peer: ("127.0.0.1", ports[peer]))
    return ts


@pytest.fixture
async def made() -> AsyncIterator[list[TcpTransport]]:
    ts: list[TcpTransport] = []
    yield ts
    for t in ts:
        t.abort()


def _payload(i: int) -> memoryview:
    return memoryview(np.full(8, i, np.int64)).cast("B")


async def _exchange(a: TcpTransport, b: TcpTransport, count: int) -> tuple[list[int], list[int]]:
    """``a`` and ``b`` each send ``count`` messages to the other at once, and receive them."""

    async def side(me: TcpTransport, peer: int) -> list[int]:
        bufs = [np.zeros(8, np.int64) for _ in range(count)]
        recvs = [me.recv(peer, (0, P2P, 1), memoryview(buf).cast("B")) for buf in bufs]
        sends = [me.send(peer, (0, P2P, 1), _payload(i)) for i in range(count)]
        await asyncio.wait_for(asyncio.gather(*sends, *recvs), 20)
        return [int(buf[0]) for buf in bufs]

    got = await asyncio.gather(side(a, b.rank), side(b, a.rank))
    return got[0], got[1]


async def test_what_is_sent_before_the_connection_arrives_whole_and_in_order(
    made: list[TcpTransport],
) -> None:
    a, b = await _unconnected(2)
    made += [a, b]
    sends = [a.send(1, (0, P2P, 3), _payload(i)) for i in range(50)]  # all before any connection
    assert not any(s.done() for s in sends)
    bufs = [np.zeros(8, np.int64) for _ in range(50)]
    recvs = [b.recv(0, (0, P2P, 3), memoryview(buf).cast("B")) for buf in bufs]
    await asyncio.wait_for(asyncio.gather(*sends, *recvs), 20)
    assert [int(buf[0]) for buf in bufs] == list(range(50))


@pytest.mark.parametrize("round_", range(10))
async def test_two_ranks_dialing_each_other_at_once_lose_nothing(
    made: list[TcpTransport], caplog: pytest.LogCaptureFixture, round_: int
) -> None:
    a, b = await _unconnected(2)
    made += [a, b]
    with caplog.at_level(logging.WARNING, logger="aiodist"):
        got_a, got_b = await _exchange(a, b, 20)
        again_a, again_b = await _exchange(a, b, 5)  # (on the one connection both kept)
    assert got_a == got_b == list(range(20))
    assert again_a == again_b == list(range(5))
    assert list(a._peers) == [1] and list(b._peers) == [0]
    assert a._peers[1].remote.split(":")[1] == str(b._peers[0].transport.get_extra_info("sockname")[1])
    # A crossing is not a fault: nobody warns of a dropped or refused connection.
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


async def test_a_ring_of_first_uses_connects_each_pair_once(made: list[TcpTransport]) -> None:
    ts = await _unconnected(4)
    made += ts
    for _ in range(3):
        await asyncio.gather(*(_exchange(ts[r], ts[(r + 1) % 4], 3) for r in range(4)))
    assert [sorted(t._peers) for t in ts] == [[1, 3], [0, 2], [1, 3], [0, 2]]


async def test_a_crossing_whose_other_connection_never_comes_fails_in_bounded_time(
    made: list[TcpTransport],
) -> None:
    a, b = await _unconnected(2)
    made += [a, b]
    a.handshake_timeout = 0.5
    stuck = asyncio.get_running_loop().create_future()
    b._dials[0] = stuck  # type: ignore[assignment]  # (rank 1 "dials" rank 0, and never gets there)
    try:
        with pytest.raises(DistNetworkError, match=r"its connection did not arrive within 0.5 s"):
            await asyncio.wait_for(a.send(1, (0, P2P, 1), _payload(1)), 20)
    finally:
        del b._dials[0]
        stuck.cancel()


async def test_a_peer_gone_before_first_use_fails_the_send_naming_it(made: list[TcpTransport]) -> None:
    a, b = await _unconnected(2)
    made += [a, b]
    lost: list[int] = []
    a.attach(0, StubMember(on_peer_lost=lambda peer, exc: lost.append(peer)))
    b.abort()  # (its port no longer listens)
    started = asyncio.get_running_loop().time()
    with pytest.raises(DistNetworkError, match=r"rank 0 could not connect to rank 1 .*left or died"):
        await asyncio.wait_for(a.send(1, (0, P2P, 1), _payload(1)), 20)
    assert asyncio.get_running_loop().time() - started < 2.0  # FAULTS: a lost peer, within 2 s
    assert lost == [1]
    with pytest.raises(DistNetworkError, match="rank 1"):  # and what comes later fails at once
        a.send(1, (0, P2P, 2), _payload(2))


async def test_a_peer_that_refuses_the_dial_is_named_with_the_cause(made: list[TcpTransport]) -> None:
    a = TcpTransport(0, 2, job="dial-on-use", secret=b"ours")
    b = TcpTransport(1, 2, job="dial-on-use", secret=b"theirs")
    made += [a, b]
    port = await b.listen("127.0.0.1")
    a.dial_on_use(lambda peer: ("127.0.0.1", port))
    with pytest.raises(DistNetworkError, match=r"rank 1 refused this rank .*AIODIST_SECRET"):
        await asyncio.wait_for(a.send(1, (0, P2P, 1), _payload(1)), 20)


async def test_a_dial_answered_by_another_rank_fails_naming_both(made: list[TcpTransport]) -> None:
    ts = await _unconnected(3)
    made += ts
    port_of_2 = ts[2].port
    ts[0].dial_on_use(lambda peer: ("127.0.0.1", port_of_2))  # (a wrong address for rank 1)
    with pytest.raises(DistNetworkError, match=r"answered as rank 2, not as rank 1"):
        await asyncio.wait_for(ts[0].send(1, (0, P2P, 1), _payload(1)), 20)


async def test_a_receive_connects_so_that_its_peer_s_death_fails_it(made: list[TcpTransport]) -> None:
    a, b = await _unconnected(2)
    made += [a, b]
    waiting = a.recv(1, (0, P2P, 1), memoryview(np.zeros(8, np.int64)).cast("B"))
    for _ in range(200):  # the receive dialed rank 1
        if 1 in a._peers:
            break
        await asyncio.sleep(0.01)
    b.abort()
    with pytest.raises(DistNetworkError, match="rank 1"):
        await asyncio.wait_for(waiting, 10)


async def test_a_send_waiting_for_its_connection_can_be_withdrawn(made: list[TcpTransport]) -> None:
    # Rank 1's "address" accepts and then says nothing: the dial waits in its handshake.
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen()
    a = TcpTransport(0, 2, job="dial-on-use", secret=b"s")
    made.append(a)
    a.dial_on_use(lambda peer: mute.getsockname())
    try:
        fut = a.send(1, (0, P2P, 1), _payload(1))
        await asyncio.sleep(0.1)
        assert not fut.done()
        assert a.cancel_send(1, fut)  # never written: nothing of it can arrive
    finally:
        mute.close()


async def test_an_abandoned_operation_s_waiting_sends_are_never_written(made: list[TcpTransport]) -> None:
    a, b = await _unconnected(2)
    made += [a, b]
    a.send(1, (0, 1, 7), _payload(7))  # a collective's message, waiting for the connection...
    a.abandon((0, 1, 7))  # ...whose operation fails here before the connection is up
    got = np.zeros(8, np.int64)
    await asyncio.wait_for(
        asyncio.gather(
            a.send(1, (0, P2P, 8), _payload(8)), b.recv(0, (0, P2P, 8), memoryview(got).cast("B"))
        ),
        20,
    )
    assert int(got[0]) == 8
    # What was sent before arrived before it, in order: nothing of the abandoned message did.
    assert b.mailbox.unexpected_bytes == 0


async def test_control_messages_dial_too(made: list[TcpTransport]) -> None:
    a, b = await _unconnected(2)
    made += [a, b]
    arrived: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    b.attach(7, StubMember(on_control=lambda src, msg: arrived.set_result((src, msg))))
    query = StateQuery(7, 1, 3, "all_reduce #3", GroupState(4, 0, 0, ()))
    a.send_control(1, query)
    assert await asyncio.wait_for(arrived, 20) == (0, query)


# -- a job: the ranks of one host at init, the others on first use ----------------------------


async def _job(hosts: list[str], monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    n = len(hosts)
    store = HashStore()
    settings = Settings.read({"AIODIST_SHM": "0"})
    for rank, where in enumerate(hosts):  # (each rank's identity names its host as it claims)
        host_of: Callable[[], str] = lambda where=where: where  # noqa: E731
        monkeypatch.setattr(_host, "host_id", host_of)
        assert await claim_rank(store, rank, n, settings) == rank
    return list(
        await asyncio.gather(
            *(
                connect_mesh(
                    store,
                    r,
                    n,
                    group_name="dial",
                    secret=None,
                    host="127.0.0.1",
                    timeout=30,
                    settings=settings,
                )
                for r in range(n)
            )
        )
    )


async def test_a_job_connects_the_ranks_of_each_host_at_init_and_the_others_on_first_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ts = await _job(["a", "a", "b", "b", "c"], monkeypatch)
    try:
        assert [sorted(t._peers) for t in ts] == [[1], [0], [3], [2], []]
        assert {t.host_keys for t in ts} == {("a", "a", "b", "b", "c")}
        got_0, got_4 = await _exchange(ts[0], ts[4], 4)
        assert got_0 == got_4 == list(range(4))
        assert sorted(ts[0]._peers) == [1, 4] and sorted(ts[4]._peers) == [0]
    finally:
        for t in ts:
            t.abort()
