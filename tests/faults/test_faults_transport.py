"""Faults at the transport level, in one process: real loopback sockets, every rank a set of
objects on one event loop (fast, and the test can look inside every rank).

FAULTS.md rows 11 and 12 (hostile bytes on a peer port), 13-16 (authentication, replay,
cross-job, a misbehaving authenticated peer), 23 (bounded unexpected memory), 25
(cancellation), and SPEC §5 (timeouts that do not poison, ``Work.wait(timeout)``, peer loss).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket as socket_mod
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from support.faults import hostile_bytes, nested_msgpack_frame
from support.waits import closed_within, eventually

import aiodist.wire.frames as frames_mod
from aiodist.errors import (
    DistError,
    DistNetworkError,
    DistTimeoutError,
    DistValueError,
    GroupOutOfStepError,
)
from aiodist.group import PEER_LOSS_GRACE, ProcessGroup
from aiodist.transport import link_watch, tcp
from aiodist.transport.base import COLL
from aiodist.transport.tcp import TcpTransport
from aiodist.wire.frames import FrameReader, encode_frame
from aiodist.wire.handshake import make_hello, parse_challenge, verify_welcome
from aiodist.wire.messages import KIND_DATA

pytestmark = pytest.mark.timeout(30)

SECRET = b"transport-fault-secret"
JOB = "faults/0123456789abcdef"


async def make_mesh(
    n: int, *, secret: bytes | None = SECRET, job: str = JOB, cap: int | None = None
) -> list[TcpTransport]:
    """``n`` transports on one loop, fully connected over loopback."""
    ts = [TcpTransport(r, n, job=job, secret=secret) for r in range(n)]
    if cap is not None:
        for t in ts:
            t.mailbox.unexpected_cap = cap
    ports = [await t.listen("127.0.0.1") for t in ts]
    await asyncio.gather(
        *(ts[r].connect(p, "127.0.0.1", ports[p], 5.0) for r in range(n) for p in range(r)),
        *(ts[r].expect(p) for r in range(n) for p in range(r + 1, n)),
    )
    return ts


@pytest.fixture
async def mesh2() -> AsyncIterator[list[TcpTransport]]:
    ts = await make_mesh(2)
    try:
        yield ts
    finally:
        for t in ts:
            t.abort()


def groups(ts: list[TcpTransport], timeout: float = 10.0) -> list[ProcessGroup]:
    return [ProcessGroup(t, range(len(ts)), 0, timeout=timeout) for t in ts]


async def raw_peer(port: int, rank: int, *, secret: bytes | None = SECRET, job: str = JOB) -> Any:
    """A hand-driven connection that authenticates as ``rank``; returns (reader, writer, hello bytes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got: list[Any] = []
    fr = FrameReader(lambda h, n: None, lambda h, p: got.append(h))

    async def next_message() -> Any:
        while not got:
            data = await reader.read(4096)
            if not data:
                raise ConnectionResetError("closed during the handshake")
            fr.feed(data)
        return got.pop(0)

    challenge = parse_challenge(await next_message())
    hello = make_hello(challenge, job, rank, secret)
    raw_hello = encode_frame(hello.pack())
    writer.write(raw_hello)
    answer = await next_message()
    if answer[0] == "refused":
        return reader, writer, raw_hello, answer
    verify_welcome(challenge, hello, answer, job, secret)
    return reader, writer, raw_hello, answer


# -- hostile bytes on a peer port (FAULTS #11, #12) --------------------------------------------
GARBAGE: dict[str, bytes] = {
    **hostile_bytes(seed=11),
    "handshake-with-payload": encode_frame(["hello"], 10) + b"0123456789",
}


@pytest.mark.parametrize("kind", list(GARBAGE))
async def test_garbage_on_a_peer_port_is_dropped(
    kind: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AIODIST_HANDSHAKE_TIMEOUT", "0.5")
    monkeypatch.setattr(tcp, "_bad_peer_warning", tcp._RateLimitedWarning())
    caplog.set_level(logging.WARNING, "aiodist.transport")
    ts = await make_mesh(2)
    try:
        g0, g1 = groups(ts)
        reader, writer = await asyncio.open_connection("127.0.0.1", ts[0].port)
        if kind == "connect-close":
            writer.close()
        else:
            writer.write(GARBAGE[kind])
            took = await closed_within(reader, 3.0)
            assert took < 1.5, took  # the handshake deadline is 0.5 s
            writer.close()
        await eventually(lambda: ts[0]._pending_handshakes == 0)
        # legitimate traffic is unaffected
        a, b = np.arange(1000, dtype=np.int64), np.zeros(1000, np.int64)
        w = g1.recv(b, 0)
        await g0.send(a, 1)
        assert await w == 0 and (a == b).all()
        assert not ts[0].dead_peers and not ts[1].dead_peers
        if kind != "connect-close":
            msgs = [r.getMessage() for r in caplog.records if r.name == "aiodist.transport"]
            assert len(msgs) == 1 and "dropped connection from 127.0.0.1:" in msgs[0], msgs
    finally:
        for t in ts:
            t.abort()


async def test_strangers_are_capped_and_dropped_at_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIODIST_HANDSHAKE_TIMEOUT", "0.5")
    monkeypatch.setattr(tcp, "MAX_PENDING_HANDSHAKES", 50)
    fds = len(os.listdir("/proc/self/fd"))
    ts = await make_mesh(2)
    try:
        conns = [await asyncio.open_connection("127.0.0.1", ts[0].port) for _ in range(120)]
        for _, w in conns:
            w.write(b"\x00")
        await asyncio.sleep(0.1)
        assert ts[0]._pending_handshakes <= 50
        closed = await asyncio.gather(*(closed_within(r, 3.0) for r, _ in conns))
        assert sum(t < 0.3 for t in closed) >= 60  # beyond the cap: dropped at once
        assert max(closed) < 1.5  # the rest at the deadline
        for _, w in conns:
            w.close()
        await eventually(lambda: ts[0]._pending_handshakes == 0)
        g0, g1 = groups(ts)
        x = np.ones(10, np.float32)
        w = g0.recv(x, 1)
        await g1.send(np.full(10, 7, np.float32), 0)
        await w
        assert (x == 7).all()
    finally:
        for t in ts:
            t.abort()
    await asyncio.sleep(0.05)
    assert len(os.listdir("/proc/self/fd")) <= fds + 2


# -- authentication (FAULTS #13, #14, #15) -----------------------------------------------------
async def test_wrong_secret_is_refused_and_nothing_it_sent_is_decoded(
    mesh2: list[TcpTransport], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(tcp, "_bad_peer_warning", tcp._RateLimitedWarning())
    monkeypatch.setattr(tcp, "_auth_warning", tcp._RateLimitedWarning())
    caplog.set_level(logging.WARNING, "aiodist.transport")
    decoded: list[Any] = []
    real = frames_mod.decode_header

    def spy(data: Any, limits: Any = frames_mod.DEFAULT_LIMITS) -> Any:
        out = real(data, limits)
        decoded.append(out)
        return out

    monkeypatch.setattr(frames_mod, "decode_header", spy)
    # 1. a transport with another secret cannot connect: DistError on its side
    rogue = TcpTransport(1, 3, job=JOB, secret=b"wrong")
    t0 = time.monotonic()
    with pytest.raises(DistError, match=r"refused|authentication"):
        await rogue.connect(0, "127.0.0.1", mesh2[0].port, 5.0)
    assert time.monotonic() - t0 < 1.0
    rogue.abort()
    # 2. a raw client sends its (wrong) hello and a data frame right behind it
    reader, writer = await asyncio.open_connection("127.0.0.1", mesh2[0].port)
    got: list[Any] = []
    fr = FrameReader(lambda h, n: None, lambda h, p: got.append(h))
    while not got:
        fr.feed(await reader.read(4096))
    hello = make_hello(parse_challenge(got[0]), JOB, 1, b"wrong")
    marker = [KIND_DATA, 0, 1, 0, ["evil-marker", 0]]
    writer.write(encode_frame(hello.pack()) + encode_frame(marker, 3) + b"abc")
    await closed_within(reader, 3.0)
    writer.close()
    assert not any(isinstance(h, list) and h[-1:] == [["evil-marker", 0]] for h in decoded)
    assert mesh2[0].mailbox.unexpected_bytes == 0
    assert any("failed authentication" in r.getMessage() for r in caplog.records)
    # the job goes on
    g0, g1 = groups(mesh2)
    await asyncio.gather(g0.collective("barrier"), g1.collective("barrier"))


async def test_replayed_handshake_is_refused(mesh2: list[TcpTransport]) -> None:
    # Record a genuine hello (to a fresh challenge), then replay it on another connection.
    _, writer, recorded, answer = await raw_peer(mesh2[0].port, 1)
    assert (
        answer[0] == "refused" and "already connected" in answer[1]
    )  # rank 1 is taken, but it was authentic
    writer.close()
    reader2, writer2 = await asyncio.open_connection("127.0.0.1", mesh2[0].port)
    got: list[Any] = []
    fr = FrameReader(lambda h, n: None, lambda h, p: got.append(h))
    while not got:
        fr.feed(await reader2.read(4096))
    writer2.write(recorded)
    while len(got) < 2:
        data = await reader2.read(4096)
        if not data:
            break
        fr.feed(data)
    assert got[1][0] == "refused" and "authentication" in got[1][1]
    writer2.close()


@pytest.mark.parametrize("other", ["secret", "job"])
async def test_no_cross_talk_between_jobs(other: str) -> None:
    a = await make_mesh(2, job="a/1111")
    b = await make_mesh(
        2, job="a/1111" if other == "secret" else "b/2222", secret=b"other" if other == "secret" else SECRET
    )
    try:
        intruder = TcpTransport(1, 2, job=b[1].job, secret=b[1].secret)
        with pytest.raises(DistError, match="refused"):
            await intruder.connect(0, "127.0.0.1", a[0].port, 5.0)
        intruder.abort()
        for mesh in (a, b):
            g0, g1 = groups(mesh)
            await asyncio.gather(g0.collective("barrier"), g1.collective("barrier"))
            assert not mesh[0].dead_peers
    finally:
        for t in a + b:
            t.abort()


# -- an authenticated peer that misbehaves (FAULTS #16) ----------------------------------------
BAD_FRAMES: dict[str, tuple[bytes, str]] = {
    "oversized-payload": (struct.pack("!IQ", 1, 1 << 62) + b"\xc0", "exceeds the limit of 1099511627776"),
    "oversized-header": (struct.pack("!IQ", 1 << 20, 0), "exceeds the limit of 65536"),
    "not-a-list": (encode_frame({"a": 1}), "malformed message header from rank 1"),
    "unhashable-key": (encode_frame([KIND_DATA, [1], 0, 0, None]), "malformed message header from rank 1"),
    "bad-fingerprint": (encode_frame([KIND_DATA, 0, 0, 0, "x"]), "malformed message fingerprint from rank 1"),
    "unknown-kind": (encode_frame([99, 0, 0, 0, None]), "unknown message kind 99 from rank 1"),
    "nested": (nested_msgpack_frame(5000), "malformed frame header"),
}


@pytest.mark.parametrize("kind", list(BAD_FRAMES))
async def test_authenticated_peer_sending_a_bad_frame_breaks_cleanly(kind: str) -> None:
    # Rank 0 of a 3-rank job; the test plays rank 1 by hand, rank 2 is a real transport.
    t0 = TcpTransport(0, 3, job=JOB, secret=SECRET)
    t2 = TcpTransport(2, 3, job=JOB, secret=SECRET)
    try:
        port = await t0.listen("127.0.0.1")
        await t2.listen("127.0.0.1")
        await t2.connect(0, "127.0.0.1", port, 5.0)
        await t0.expect(2)
        reader, writer, _, answer = await raw_peer(port, 1)
        assert answer[0] == "welcome"
        await t0.expect(1)
        g0 = ProcessGroup(t0, range(3), 0, timeout=10)
        sub = ProcessGroup(t0, [0, 2], 1, timeout=10)
        pending = g0.recv(np.zeros(4, np.float32), 1)
        blob, why = BAD_FRAMES[kind]
        writer.write(blob)
        t_sent = time.monotonic()
        await closed_within(reader, 3.0)
        with pytest.raises(DistNetworkError, match="rank 1") as info:
            await asyncio.wait_for(pending, 3.0)
        assert time.monotonic() - t_sent < 1.0
        assert why in str(info.value.__cause__ or info.value) or why in str(t0.dead_peers[1])
        assert why in str(t0.dead_peers[1])
        with pytest.raises(DistNetworkError, match="rank 1"):
            g0.collective("barrier")  # the group is broken: later calls raise at once
        # a group without rank 1 goes on
        sub2 = ProcessGroup(t2, [0, 2], 1, timeout=10)
        await asyncio.gather(sub.collective("barrier"), sub2.collective("barrier"))
        writer.close()
    finally:
        t0.abort()
        t2.abort()


# -- bounded unexpected memory --------------------------------------------------------------------
async def test_unexpected_messages_never_exceed_the_cap() -> None:
    cap = 1 << 20
    ts = await make_mesh(2, cap=cap)
    peak = 0
    mb = ts[0].mailbox
    real = mb.deliver

    def spy(*args: Any, **kwargs: Any) -> None:
        nonlocal peak
        real(*args, **kwargs)
        peak = max(peak, mb.unexpected_bytes + ts[0]._incoming)

    mb.deliver = spy  # type: ignore[method-assign]
    try:
        g0, g1 = groups(ts)
        small = [np.full(128 * 1024, i, np.float32) for i in range(12)]  # 12 x 512 KiB, tag 1
        big = np.arange(4 << 20, dtype=np.float32)  # 16 MiB, tag 2: alone more than the cap
        sends = [g1.send(a, 0, tag=1) for a in small] + [g1.send(big, 0, tag=2)]
        await asyncio.sleep(0.3)
        assert mb.unexpected_bytes + ts[0]._incoming <= cap
        assert ts[0]._deferred  # reading from rank 1 is paused, not buffering without bound
        got_big = np.zeros_like(big)
        got_small = [np.zeros_like(a) for a in small]
        recvs = [g0.recv(b, 1, tag=1) for b in got_small]
        recvs.append(g0.recv(got_big, 1, tag=2))
        await asyncio.wait_for(asyncio.gather(*recvs, *sends), 10)
        assert all((a == b).all() for a, b in zip(small, got_small, strict=True))
        assert (got_big == big).all()
        assert peak <= cap and mb.unexpected_bytes == 0 and not ts[0]._deferred
    finally:
        for t in ts:
            t.abort()


async def test_timeout_while_paused_at_the_cap_says_why_and_recovers() -> None:
    ts = await make_mesh(2, cap=256 * 1024)
    try:
        g0, g1 = groups(ts)
        big = np.arange(1 << 18, dtype=np.float64)  # 2 MiB on tag 1, then a small one on tag 2
        s1 = g1.send(big, 0, tag=1)
        s2 = g1.send(np.array([42.0]), 0, tag=2)
        small = np.zeros(1)
        with pytest.raises(DistTimeoutError, match=r"paused.*AIODIST_UNEXPECTED_CAP") as info:
            await g0.recv(small, 1, tag=2, timeout=0.5)
        assert "recv from rank 1 (tag 2)" in str(info.value)
        got = np.zeros_like(big)
        await asyncio.wait_for(g0.recv(got, 1, tag=1), 5)
        assert (got == big).all()
        await asyncio.wait_for(g0.recv(small, 1, tag=2), 5)
        assert small[0] == 42.0
        await asyncio.gather(s1, s2)
    finally:
        for t in ts:
            t.abort()


# -- a silent peer's host is lost after AIODIST_LINK_TIMEOUT; a stopped reader is not --------------
# (a real cut link needs hosts of their own: tests/hosts/test_host_failures.py)


def _socket_of(t: TcpTransport, peer: int) -> Any:
    proto = t._peers[peer]
    assert proto.transport is not None
    return proto.transport.get_extra_info("socket")


async def test_every_peer_connection_is_probed_when_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ends, accepted and connected, send keepalive probes from a quarter of the link
    timeout of silence on: an idle connection to a vanished host has something to go unanswered."""
    monkeypatch.setenv("AIODIST_LINK_TIMEOUT", "8")
    ts = await make_mesh(3)
    try:
        for t in ts:
            for peer in (p for p in range(3) if p != t.rank):
                sock = _socket_of(t, peer)
                assert sock.getsockopt(socket_mod.SOL_SOCKET, socket_mod.SO_KEEPALIVE) == 1
                if hasattr(socket_mod, "TCP_KEEPIDLE"):
                    assert sock.getsockopt(socket_mod.IPPROTO_TCP, socket_mod.TCP_KEEPIDLE) == 2
    finally:
        for t in ts:
            t.abort()


async def test_a_link_timeout_of_zero_leaves_the_kernel_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIODIST_LINK_TIMEOUT", "0")
    ts = await make_mesh(2)
    try:
        assert _socket_of(ts[0], 1).getsockopt(socket_mod.SOL_SOCKET, socket_mod.SO_KEEPALIVE) == 0
    finally:
        for t in ts:
            t.abort()


@pytest.mark.parametrize("value", ["soon", "-1", "inf"])
def test_a_bad_link_timeout_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("AIODIST_LINK_TIMEOUT", value)
    with pytest.raises(DistValueError, match=rf"AIODIST_LINK_TIMEOUT='{value}'"):
        TcpTransport(0, 2, job=JOB, secret=SECRET, loop=asyncio.new_event_loop())


async def test_a_silent_host_fails_what_waits_on_it_naming_the_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a cut link looks like to the kernel (rank 1's host acknowledges nothing while data
    waits) is simulated here by the one function that reads it from the kernel; the real cut
    is tests/hosts/test_host_failures.py. Rank 0's receive fails within about the link timeout,
    naming rank 1 and why, and the group is broken."""
    monkeypatch.setenv("AIODIST_LINK_TIMEOUT", "0.4")
    ts = await make_mesh(2)
    try:
        g0, _ = groups(ts, timeout=20.0)
        sock = _socket_of(ts[0], 1)
        real = link_watch.unanswered_ms
        monkeypatch.setattr(link_watch, "unanswered_ms", lambda s: 10_000 if s is sock else real(s))
        t0 = time.monotonic()
        with pytest.raises(
            DistNetworkError, match=r"rank 1 stopped answering: its host acknowledged nothing for"
        ) as info:
            await asyncio.wait_for(g0.recv(np.zeros(4), 1), 10)
        assert time.monotonic() - t0 < 5.0  # (0.4 s of silence, seen on two checks 0.1 s apart)
        assert "AIODIST_LINK_TIMEOUT" in str(info.value) and "network path to it is cut" in str(info.value)
        with pytest.raises(DistNetworkError, match="rank 1"):  # the group is broken
            await asyncio.wait_for(g0.collective("all_reduce", np.zeros(2)), 5)
    finally:
        for t in ts:
            t.abort()


async def test_a_reader_that_leaves_its_buffer_full_is_not_a_lost_link(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rank that reads nothing for three link timeouts (busy elsewhere, stopped, or paused at
    the unexpected cap as here) still has its kernel answer its peer's probes: the connection
    stays, and the 32 MiB message arrives whole once its receive is posted."""
    monkeypatch.setenv("AIODIST_LINK_TIMEOUT", "1")
    ts = await make_mesh(2, cap=1 << 20)
    try:
        g0, g1 = groups(ts, timeout=20.0)
        big = np.arange(8 << 20, dtype=np.int32)  # far more than both socket buffers hold
        sent = g1.send(big, 0, tag=1)
        await asyncio.sleep(3.5)
        assert ts[0]._deferred, "reading from rank 1 should be paused (the message exceeds the cap)"
        assert not sent.is_completed() and not ts[0].dead_peers and not ts[1].dead_peers
        got = np.zeros_like(big)
        await asyncio.wait_for(asyncio.gather(g0.recv(got, 1, tag=1), sent), 10)
        assert (got == big).all()
    finally:
        for t in ts:
            t.abort()


# -- cancellation never leaves a half-read frame (FAULTS #25) ------------------------------------
async def test_cancelled_waiters_leave_operations_and_the_stream_intact(mesh2: list[TcpTransport]) -> None:
    g0, g1 = groups(mesh2)
    payloads = [np.random.default_rng(i).integers(0, 1 << 60, 1 << 20) for i in range(4)]  # 8 MiB each
    outs = [np.zeros_like(p) for p in payloads]
    works = [g0.recv(o, 1, tag=5) for o in outs]
    waiters = [asyncio.ensure_future(w) for w in works]
    sends = [g1.send(p, 0, tag=5) for p in payloads]
    reader = mesh2[0]._peers[1]._reader
    for _ in range(10_000):
        if reader.mid_frame:
            break
        await asyncio.sleep(0)
    assert reader.mid_frame  # a payload is half-way through the socket now
    for task in waiters:
        task.cancel()
    await asyncio.sleep(0)
    assert all(task.cancelled() for task in waiters)
    for w in works:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(w, 0.0001)  # a timed-out wait_for cancels its waiter too
    for w in works:
        assert await w == 1  # awaiting again returns the operation's result
    await asyncio.gather(*sends)
    assert all((p == o).all() for p, o in zip(payloads, outs, strict=True))
    # the connection carries on, frame boundaries intact
    x = np.zeros(3, np.int32)
    w = g0.recv(x, 1, tag=6)
    await g1.send(np.array([1, 2, 3], np.int32), 0, tag=6)
    await w
    assert x.tolist() == [1, 2, 3]


async def test_work_wait_timeout_leaves_the_operation_running(mesh2: list[TcpTransport]) -> None:
    g0, g1 = groups(mesh2)
    buf = np.zeros(5, np.int64)
    work = g0.recv(buf, 1)
    t0 = time.monotonic()
    with pytest.raises(DistTimeoutError, match="still running"):
        await asyncio.to_thread(work.wait, 0.2)
    assert 0.15 < time.monotonic() - t0 < 2.0
    assert not work.is_completed()
    await g1.send(np.arange(5, dtype=np.int64), 0)
    assert await asyncio.to_thread(work.wait, 5.0) is True
    assert buf.tolist() == [0, 1, 2, 3, 4]


# -- timeouts do not poison the group; peer loss does break it -------------------------------------
async def _all_reduce_like(g: ProcessGroup, x: np.ndarray, timeout: float | None = None) -> Any:
    """A tiny ring sum over the group's COLL channel (the transport view of a collective)."""
    from aiodist.collectives.allreduce import allreduce
    from aiodist.collectives.steps import run
    from aiodist.ops import ReduceOp

    return await g.run_collective(
        "all_reduce",
        lambda ctx: run(allreduce(ctx, x, ReduceOp.SUM)),
        timeout,
        dtype=str(x.dtype),
        count=x.size,
    )


async def test_timed_out_collective_then_a_correct_one() -> None:
    ts = await make_mesh(3)
    try:
        gs = groups(ts, timeout=0.5)
        xs = [np.full(1 << 16, r + 1, np.float64) for r in range(3)]
        # ranks 0 and 1 start all_reduce #0; rank 2 comes too late
        early = [asyncio.ensure_future(_all_reduce_like(gs[r], xs[r])) for r in (0, 1)]
        t0 = time.monotonic()
        for fut in early:
            with pytest.raises(
                DistTimeoutError, match=r"all_reduce #0 on rank \d .*reached its timeout of 0.5 s"
            ) as info:
                await fut
            assert "waiting for data from rank" in str(info.value)
            assert "rank 2 never entered it" in str(info.value) and "out of step" in str(info.value)
        assert 0.45 < time.monotonic() - t0 < 2.5
        # rank 2, too late, is told at once that the ranks disagree about #0 (no second timeout)
        with pytest.raises(GroupOutOfStepError, match="rank 2 at no operation yet"):
            await _all_reduce_like(gs[2], xs[2])
        reports = await asyncio.gather(*(g.resync(timeout=10) for g in gs))
        assert [r.next_op for r in reports] == [1, 1, 1]
        await asyncio.sleep(0.1)
        assert all(t.mailbox.unexpected_bytes == 0 for t in ts)
        ys = [np.full(1 << 16, 10 * (r + 1), np.float64) for r in range(3)]
        await asyncio.gather(*(_all_reduce_like(gs[r], ys[r], timeout=10) for r in range(3)))
        assert all((y == 60).all() for y in ys)
        assert all(g.broken is None and g.out_of_step is None for g in gs)
    finally:
        for t in ts:
            t.abort()


async def test_lost_peer_fails_pending_ops_that_do_not_need_it_after_the_grace() -> None:
    ts = await make_mesh(3)
    try:
        gs = groups(ts, timeout=60)
        # rank 2 waits for rank 1, which will never send: only the loss of rank 0 can end it
        stuck = gs[2].recv(np.zeros(1), 1, tag=3)
        direct = gs[1].recv(np.zeros(1), 0, tag=4)
        ts[0].abort()  # rank 0 "dies": its sockets close without a goodbye
        t0 = time.monotonic()
        with pytest.raises(DistNetworkError, match="rank 0"):
            await asyncio.wait_for(direct, 5)
        assert time.monotonic() - t0 < 0.5  # it needed rank 0: at once
        with pytest.raises(DistNetworkError, match="rank 0") as info:
            await asyncio.wait_for(stuck, 5)
        took = time.monotonic() - t0
        assert PEER_LOSS_GRACE * 0.9 <= took < PEER_LOSS_GRACE + 1.5, took
        assert "recv from rank 1 (tag 3)" in str(info.value)
        with pytest.raises(DistNetworkError, match="broken"):
            gs[1].collective("barrier")
    finally:
        for t in ts:
            t.abort()


async def test_orderly_leave_is_not_a_loss() -> None:
    ts = await make_mesh(3)
    try:
        gs = groups(ts, timeout=60)
        pending = gs[2].recv(np.zeros(1), 1, tag=3)
        await ts[0].aclose()  # rank 0 leaves with a goodbye
        await asyncio.sleep(PEER_LOSS_GRACE + 0.3)
        assert not pending.is_completed()  # ops not needing rank 0 go on
        await gs[1].send(np.ones(1), 2, tag=3)
        await asyncio.wait_for(pending, 5)
        with pytest.raises(DistNetworkError, match="rank 0 has left"):
            await gs[1].recv(np.zeros(1), 0)
    finally:
        for t in ts:
            t.abort()


async def test_abandoned_key_frames_are_dropped_not_held() -> None:
    ts = await make_mesh(2)
    try:
        key = (0, COLL, 7)
        ts[0].abandon(key)
        await ts[1].send(
            0, key, memoryview(bytearray(1 << 20)), ["all_reduce", 7, "uint8", 1 << 20, -1, None]
        )
        await asyncio.sleep(0.1)
        assert ts[0].mailbox.unexpected_bytes == 0
    finally:
        for t in ts:
            t.abort()


async def test_p2p_mismatch_fails_that_receive_and_tells_the_sender(mesh2: list[TcpTransport]) -> None:
    """The receive fails; the sender's send had completed (a small one completes once queued),
    so its next send to that rank with that tag raises the refusal, sending nothing; after
    that the tag works again, and neither group is broken."""
    from aiodist.errors import CollectiveMismatchError

    g0, g1 = groups(mesh2)
    bad = g1.recv(np.zeros(20, np.float32), 0)
    await g0.send(np.zeros(10, np.float32), 1)
    with pytest.raises(CollectiveMismatchError, match="rank 0 sent send of 10 x float32"):
        await bad
    # The refusal travels to rank 0 before this message, on the same connection.
    await g1.send(np.zeros(1), 0, tag=1)
    await g0.recv(np.zeros(1), 1, tag=1)
    with pytest.raises(CollectiveMismatchError, match="rank 1 expected send of 20 x float32 but rank 0 sent"):
        g0.send(np.arange(3, dtype=np.float32), 1)
    x = np.zeros(3, np.float32)
    w = g1.recv(x, 0)  # the same tag: the next message is received normally
    await g0.send(np.arange(3, dtype=np.float32), 1)
    await w
    assert x.tolist() == [0.0, 1.0, 2.0]
    assert g0.broken is None and g1.broken is None
