"""TCPStore and StoreServer: connecting, concurrency, authentication, and hostile clients.

FAULTS.md rows 4 (server gone), 5 (nothing listening), 11 (garbage), 12 (unauthenticated
flood) and 13 (wrong secret), on real loopback sockets.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import random
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvloop
from support.faults import hostile_bytes, nested_msgpack_frame
from support.waits import closed_within, eventually

from aiodist.errors import DistStoreError, DistTimeoutError, DistTypeError, DistValueError
from aiodist.store import StoreServer, TCPStore
from aiodist.store.base import ForeignStoreError, StoreShutDownError
from aiodist.store.client import SILENCE_VERDICT, _chunks
from aiodist.store.server import MAX_VALUE_BYTES
from aiodist.wire.frames import FrameReader, encode_frame
from aiodist.wire.handshake import make_hello, parse_challenge, verify_welcome

pytestmark = pytest.mark.timeout(20)

SECRET = b"tcp-test-secret"
JOB = "aiodist-store"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def master() -> AsyncIterator[TCPStore]:
    m = TCPStore("127.0.0.1", 0, is_master=True, timeout=5, secret=SECRET, handshake_timeout=0.5)
    await m.start()
    try:
        yield m
    finally:
        await m.aclose()


def server_of(m: TCPStore) -> StoreServer:
    server = m.server
    assert server is not None
    return server


async def authenticated(port: int, secret: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw connection that passed the handshake, for sending hand-made frames."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    frames: list[Any] = []
    fr = FrameReader(lambda h, n: None, lambda h, p: frames.append(h))

    async def next_message() -> Any:
        while not frames:
            fr.feed(await reader.read(4096))
        return frames.pop(0)

    challenge = parse_challenge(await next_message())
    hello = make_hello(challenge, JOB, -1, secret)
    writer.write(encode_frame(hello.pack()))
    verify_welcome(challenge, hello, await next_message(), JOB, secret)
    return reader, writer


# -- construction and connecting -------------------------------------------------------------
async def test_constructor_validation() -> None:
    with pytest.raises(DistValueError):
        TCPStore("127.0.0.1", 0)
    with pytest.raises(DistValueError):
        TCPStore("127.0.0.1", 70000)
    with pytest.raises(DistTypeError):
        TCPStore(123, 5000)  # type: ignore[arg-type]
    with pytest.raises(DistTypeError):
        TCPStore("127.0.0.1", "5000")  # type: ignore[arg-type]
    with pytest.raises(DistValueError):
        TCPStore("127.0.0.1", 5000, world_size=0)
    with pytest.raises(DistValueError, match="is_master"):
        TCPStore("127.0.0.1", 5000, sock=socket.socket())
    with pytest.raises(DistTypeError):
        TCPStore("127.0.0.1", 5000, secret="text")  # type: ignore[arg-type]


async def test_ephemeral_port_known_after_start() -> None:
    m = TCPStore("127.0.0.1", 0, world_size=3, is_master=True, secret=SECRET)
    assert m.port == 0 and m.server is None
    await m.start()
    try:
        assert m.port > 0 and m.server is not None and m.server.port == m.port
        assert m.world_size == 3 and m.is_master and m.host == "127.0.0.1"
        assert "master" in repr(m)
    finally:
        await m.aclose()


async def test_localhost_master_binds_loopback_only() -> None:
    async with TCPStore("localhost", 0, is_master=True, secret=SECRET) as m:
        server = m.server
        assert server is not None and server._server is not None
        addrs = {s.getsockname()[0] for s in server._server.sockets}
        assert addrs == {"127.0.0.1"}
        await m.set("k", b"v")
        async with TCPStore("localhost", m.port, secret=SECRET) as c:
            assert await c.get("k") == b"v"


async def test_prebound_listening_socket() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    async with TCPStore("127.0.0.1", port, is_master=True, sock=sock, secret=SECRET) as m:
        assert m.port == port
        async with TCPStore("127.0.0.1", port, secret=SECRET) as c:
            await c.set("via-sock", b"1")
        assert await m.get("via-sock") == b"1"


async def test_master_on_a_taken_port_names_the_cause(master: TCPStore) -> None:
    other = TCPStore("127.0.0.1", master.port, is_master=True, secret=SECRET)
    with pytest.raises(DistStoreError, match=f"127.0.0.1:{master.port}") as info:
        await other.start()
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.__cause__.errno == errno.EADDRINUSE
    await other.aclose()


def test_a_listen_lost_to_another_process_is_a_taken_port_under_uvloop() -> None:
    # Two would-be hosts can both bind a port (SO_REUSEADDR); the later listen() fails, and
    # uvloop reports that by closing the server's handle instead of raising.
    async def lose_the_race() -> None:
        late = socket.socket()
        late.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        late.bind(("127.0.0.1", 0))
        port = late.getsockname()[1]
        async with TCPStore("127.0.0.1", port, is_master=True, secret=SECRET):
            loser = TCPStore("127.0.0.1", port, is_master=True, sock=late, secret=SECRET)
            with pytest.raises(DistStoreError, match=f"127.0.0.1:{port}") as info:
                await loser.start()
            assert isinstance(info.value.__cause__, OSError)
            assert info.value.__cause__.errno == errno.EADDRINUSE
            await loser.aclose()

    uvloop.run(lose_the_race())


async def test_nothing_listening_fails_after_the_timeout() -> None:
    port = free_port()
    timeout = 1.0
    client = TCPStore("127.0.0.1", port, timeout=timeout, secret=SECRET)
    t0 = time.monotonic()
    with pytest.raises(DistStoreError) as info:
        await client.get("k")
    elapsed = time.monotonic() - t0
    assert 0.9 * timeout <= elapsed <= 1.1 * timeout
    msg = str(info.value)
    assert f"127.0.0.1:{port}" in msg and "attempts" in msg and "ConnectionRefused" in msg


async def test_client_retries_until_the_server_appears() -> None:
    port = free_port()
    client = TCPStore("127.0.0.1", port, timeout=5, secret=SECRET)
    getter = asyncio.create_task(client.get("k"))
    await asyncio.sleep(0.4)
    assert not getter.done()
    async with TCPStore("127.0.0.1", port, is_master=True, secret=SECRET) as m:
        await m.set("k", b"at last")
        assert await asyncio.wait_for(getter, 3) == b"at last"
        await client.aclose()


def _store_host_that_wakes_late(port: int, asleep: float, done: threading.Event) -> None:
    """A store host in its own thread whose loop is busy for ``asleep`` s after it starts listening."""

    async def host() -> None:
        async with TCPStore("127.0.0.1", port, is_master=True, secret=SECRET):
            time.sleep(asleep)  # connections queue in the kernel until the loop runs again
            while not done.is_set():
                await asyncio.sleep(0.01)

    uvloop.run(host())


async def test_a_stall_of_our_own_loop_is_not_taken_for_a_silent_listener() -> None:
    """The client's loop stalls past SILENCE_VERDICT while the host's challenge is on its way.

    After a stall the loop fires its due timers before it reads its sockets: the challenge
    that arrived meanwhile must still be read, and the store joined, not named a foreign program.
    """
    port, done = free_port(), threading.Event()
    host = threading.Thread(target=_store_host_that_wakes_late, args=(port, 1.0, done))
    host.start()
    try:
        await asyncio.sleep(0.3)  # the host listens (and sleeps)
        asyncio.get_running_loop().call_later(0.3, time.sleep, SILENCE_VERDICT + 0.5)
        client = TCPStore("127.0.0.1", port, timeout=15, secret=SECRET)
        await client.start()
        await client.set("k", b"joined")
        assert await client.get("k") == b"joined"
        await client.aclose()
    finally:
        done.set()
        await asyncio.to_thread(host.join, 10)


@pytest.mark.parametrize("behaviour", ["http", "silent", "close-at-once"])
async def test_a_listener_that_is_not_a_store_is_named_fast(behaviour: str) -> None:
    held: list[asyncio.StreamWriter] = []

    async def other_program(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if behaviour == "silent":
            held.append(writer)  # accept and never answer
            return
        if behaviour == "http":
            writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(other_program, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        client = TCPStore("127.0.0.1", port, timeout=60, secret=SECRET)
        t0 = time.monotonic()
        with pytest.raises(ForeignStoreError) as info:
            await client.start()
        took = time.monotonic() - t0
        # seconds, not the 60 s timeout: at once for an answer, SILENCE_VERDICT for silence
        assert took < (1.0 if behaviour == "http" else SILENCE_VERDICT + 3.0), took
        assert behaviour == "http" or took >= SILENCE_VERDICT - 0.1, took
        msg = str(info.value)
        assert f"127.0.0.1:{port}" in msg and "already in use by another program" in msg, msg
        assert "--master-port" in msg and info.value.holder == "program", msg
        why = {
            "http": "HTTP/1.1 400",
            "silent": f"it accepted the connection but sent nothing in {SILENCE_VERDICT:g} s",
            "close-at-once": "closed it without a word",
        }
        assert why[behaviour] in msg, msg  # (what it did, not a guess)
    finally:
        for w in held:
            w.close()
        server.close()
        await server.wait_closed()


async def test_a_store_shut_down_in_order_is_told_apart_from_a_crash() -> None:
    m = TCPStore("127.0.0.1", 0, is_master=True, secret=SECRET)
    await m.start()
    client = TCPStore("127.0.0.1", m.port, timeout=30, secret=SECRET)
    waiting = asyncio.create_task(client.wait(["never"]))
    await asyncio.sleep(0.05)
    await m.aclose()
    with pytest.raises(StoreShutDownError, match="closed the connection: its host shut the store down"):
        await asyncio.wait_for(waiting, 2)
    with pytest.raises(StoreShutDownError):
        await client.set("after", b"lost")
    await client.aclose()


# -- one connection, many requests -----------------------------------------------------------
async def test_one_connection_carries_concurrent_requests(master: TCPStore) -> None:
    client = TCPStore("127.0.0.1", master.port, timeout=10, secret=SECRET)
    await client.start()
    getters = [asyncio.create_task(client.get(f"g{i}")) for i in range(300)]
    adds = [asyncio.create_task(client.add("sum", i)) for i in range(300)]
    await asyncio.sleep(0.05)
    assert server_of(master).num_connections == 2  # the master's own client, and this one
    await master.multi_set([f"g{i}" for i in range(300)], [str(i * i) for i in range(300)])
    assert await asyncio.gather(*getters) == [str(i * i).encode() for i in range(300)]
    await asyncio.gather(*adds)
    assert await client.get("sum") == str(sum(range(300))).encode()
    assert not client._pending
    await client.aclose()


async def test_cancelled_request_is_withdrawn_from_the_server(master: TCPStore) -> None:
    client = TCPStore("127.0.0.1", master.port, timeout=10, secret=SECRET)
    tasks = [asyncio.create_task(client.get("never")) for _ in range(5)]
    await asyncio.sleep(0.1)
    server = server_of(master)
    assert sum(len(c.tasks) for c in server._conns) == 5
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await eventually(lambda: sum(len(c.tasks) for c in server._conns) == 0)
    assert not client._pending
    await client.set("still", b"works")
    assert await master.get("still") == b"works"
    await client.aclose()


async def test_many_keys_are_split_into_requests(master: TCPStore) -> None:
    keys = [f"key-{i:05d}" for i in range(20000)]
    values = [str(i).encode() for i in range(20000)]
    await master.multi_set(keys, values)
    assert await master.num_keys() == 20000
    assert await master.multi_get(keys) == values
    assert await master.check(keys)
    await master.wait(keys, timeout=2)
    assert not await master.check([*keys, "missing"])


def test_chunks_respect_payload_and_key_limits() -> None:
    big = b"x" * (MAX_VALUE_BYTES // 2 + 1)
    chunks = list(_chunks(["a", "b", "c", "d", "e"], [big] * 5))
    assert [c[0] for c in chunks] == [["a", "b", "c"], ["d", "e"]]
    assert list(_chunks([])) == [([], [])]
    many = list(_chunks([str(i) for i in range(20000)]))
    assert sum(len(c[0]) for c in many) == 20000 and all(len(c[0]) <= 8192 for c in many)


async def test_large_values(master: TCPStore) -> None:
    value = random.Random(1).randbytes(16 << 20)
    await master.set("big", value)
    assert await master.get("big") == value
    with pytest.raises(DistValueError, match="exceeds"):
        await master.set("huge", bytes(MAX_VALUE_BYTES + 1))
    with pytest.raises(DistValueError, match="exceeds"):
        await master.get("k" * (70 << 10))


# -- the server goes away (FAULTS #4) --------------------------------------------------------
@pytest.mark.parametrize("how", ["aclose", "abort"])
async def test_server_gone_fails_every_call_fast(how: str) -> None:
    m = TCPStore("127.0.0.1", 0, is_master=True, secret=SECRET)
    await m.start()
    client = TCPStore("127.0.0.1", m.port, timeout=30, secret=SECRET)
    await client.set("k", b"v")
    waiting = [asyncio.create_task(client.get("never")), asyncio.create_task(client.wait(["never", "k"]))]
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    if how == "aclose":
        await m.aclose()
    else:
        m.abort()
    for task in waiting:
        with pytest.raises(DistStoreError, match=f"store at 127.0.0.1:{m.port} closed the connection"):
            await asyncio.wait_for(task, 1.0)
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(DistStoreError, match="closed the connection"):
        await client.set("after", b"lost")  # never a silent success
    with pytest.raises(DistStoreError, match="closed the connection"):
        await client.num_keys()
    await client.aclose()


async def test_a_vanished_client_does_not_disturb_the_server(master: TCPStore) -> None:
    doomed = TCPStore("127.0.0.1", master.port, timeout=30, secret=SECRET)
    pending = asyncio.create_task(doomed.wait(["x"]))
    await asyncio.sleep(0.05)
    doomed.abort()
    with pytest.raises(DistStoreError):
        await pending
    await eventually(lambda: server_of(master).num_connections == 1)
    await master.set("x", b"fine")
    assert await master.get("x") == b"fine"


# -- authentication (FAULTS #13) -------------------------------------------------------------
async def test_wrong_secret_is_refused_fast(master: TCPStore, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "aiodist.store")
    for bad in (b"wrong-secret", b""):
        intruder = TCPStore("127.0.0.1", master.port, timeout=10, secret=bad)
        t0 = time.monotonic()
        with pytest.raises(DistStoreError, match="authentication failed"):
            await intruder.set("k", b"evil")
        assert time.monotonic() - t0 < 1.0
    assert await master.num_keys() == 0
    assert any("refused 127.0.0.1:" in r.getMessage() for r in caplog.records)
    async with TCPStore("127.0.0.1", master.port, secret=SECRET) as friend:
        await friend.set("k", b"good")
    assert await master.get("k") == b"good"


async def test_secret_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIODIST_SECRET", "env-secret")
    async with TCPStore("127.0.0.1", 0, is_master=True) as m:
        async with TCPStore("127.0.0.1", m.port) as c:
            await c.set("k", b"v")
        with pytest.raises(DistStoreError, match="authentication failed"):
            await TCPStore("127.0.0.1", m.port, secret=b"other").start()
    monkeypatch.delenv("AIODIST_SECRET")
    # no secret on either side
    async with TCPStore("127.0.0.1", 0, is_master=True) as m, TCPStore("127.0.0.1", m.port) as c:
        assert await c.add("k", 2) == 2


# -- hostile clients (FAULTS #11, #12) -------------------------------------------------------
GARBAGE: dict[str, bytes] = {
    **hostile_bytes(seed=7),
    "nested-msgpack-1000": nested_msgpack_frame(1000),
}


@pytest.mark.parametrize("kind", list(GARBAGE))
async def test_garbage_connection_is_dropped(
    master: TCPStore, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "aiodist.store")
    reader, writer = await asyncio.open_connection("127.0.0.1", master.port)
    if kind == "connect-close":
        writer.close()
    else:
        writer.write(GARBAGE[kind])
        # the server's handshake deadline is 0.5 s: nothing may outlive it by much
        assert await closed_within(reader, 2.0) < 1.0
        writer.close()
    await eventually(lambda: server_of(master).num_connections == 1)
    assert any("127.0.0.1:" in r.getMessage() for r in caplog.records)
    async with TCPStore("127.0.0.1", master.port, timeout=2, secret=SECRET) as client:
        await client.set("k", b"v")
        assert await master.get("k") == b"v"


async def test_slow_drip_is_dropped_at_the_deadline(master: TCPStore) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", master.port)
    t0 = time.monotonic()

    async def drip() -> None:
        for b in struct.pack("!IQ", 40, 0) + b"\x00" * 40:
            writer.write(bytes([b]))
            await asyncio.sleep(0.05)

    dripper = asyncio.create_task(drip())
    await closed_within(reader, 2.0)
    assert 0.4 <= time.monotonic() - t0 < 1.2
    dripper.cancel()
    writer.close()


async def test_unauthenticated_connections_are_capped() -> None:
    server = StoreServer("127.0.0.1", 0, secret=SECRET, handshake_timeout=0.5, max_unauthenticated=3)
    async with server:
        fds_before = len(os.listdir("/proc/self/fd"))
        silent = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(8)]
        await asyncio.sleep(0.1)
        # beyond the cap, connections are dropped at once; the others at the deadline
        assert server._unauthenticated == 3
        closed = await asyncio.gather(*(closed_within(r, 2.0) for r, _ in silent))
        assert sum(t < 0.2 for t in closed) >= 5
        assert max(closed) < 1.0
        for _, w in silent:
            w.close()
        await eventually(lambda: server.num_connections == 0)
        async with TCPStore("127.0.0.1", server.port, timeout=3, secret=SECRET) as client:
            await client.set("k", b"v")
        await eventually(lambda: server.num_connections == 0)
        assert len(os.listdir("/proc/self/fd")) <= fds_before


async def test_legit_client_gets_in_during_a_flood() -> None:
    server = StoreServer("127.0.0.1", 0, secret=SECRET, handshake_timeout=0.3, max_unauthenticated=4)
    async with server:
        stop = asyncio.Event()

        async def flood() -> None:
            while not stop.is_set():
                try:
                    _, w = await asyncio.open_connection("127.0.0.1", server.port)
                except OSError:
                    continue
                w.write(b"\x00")
                await asyncio.sleep(0.02)

        flooders = [asyncio.create_task(flood()) for _ in range(4)]
        try:
            async with TCPStore("127.0.0.1", server.port, timeout=8, secret=SECRET) as client:
                assert await client.add("n", 1) == 1
        finally:
            stop.set()
            await asyncio.gather(*flooders, return_exceptions=True)


async def test_warnings_are_rate_limited(master: TCPStore, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "aiodist.store")
    for _ in range(20):
        reader, writer = await asyncio.open_connection("127.0.0.1", master.port)
        writer.write(GARBAGE["http"])
        await closed_within(reader, 2.0)
        writer.close()
    warnings = [r for r in caplog.records if r.name == "aiodist.store" and r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "127.0.0.1:" in warnings[0].getMessage()


BAD_REQUESTS: dict[str, bytes] = {
    "oversized-payload": struct.pack("!IQ", 5, 1 << 62) + b"\x95\x00\x00\x00\x00",
    "nested-too-deep": nested_msgpack_frame(100_000),
    "nested-shallow": nested_msgpack_frame(1000),
    "unknown-op": encode_frame(["explode", 1, [], [], None]),
    "not-a-list": encode_frame({"op": "get"}),
    "lens-mismatch": encode_frame(["set", 1, ["k"], [10], None], 3) + b"abc",
    "wrong-key-count": encode_frame(["get", 1, ["a", "b"], [], 1.0]),
    "negative-timeout": encode_frame(["wait", 1, ["a"], [], -1.0]),
    "bool-rid": encode_frame(["num_keys", True, [], [], None]),
    "key-not-str": encode_frame(["check", 1, [b"k"], [], None]),
}


@pytest.mark.parametrize("kind", list(BAD_REQUESTS))
async def test_authenticated_bad_frame_drops_only_that_connection(
    master: TCPStore, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "aiodist.store")
    bystander = TCPStore("127.0.0.1", master.port, timeout=10, secret=SECRET)
    pending = asyncio.create_task(bystander.get("later"))
    reader, writer = await authenticated(master.port, SECRET)
    writer.write(BAD_REQUESTS[kind])
    assert await closed_within(reader, 2.0) < 0.5
    writer.close()
    assert any("dropped 127.0.0.1:" in r.getMessage() for r in caplog.records)
    await master.set("later", b"unaffected")
    assert await pending == b"unaffected"
    await bystander.aclose()


async def test_raw_protocol_round_trip(master: TCPStore) -> None:
    """The documented frame layout, spoken by hand."""
    reader, writer = await authenticated(master.port, SECRET)
    responses: list[tuple[Any, bytes]] = []
    fr = FrameReader(lambda h, n: None, lambda h, p: responses.append((h, bytes(p))))
    writer.write(encode_frame(["set", 7, ["raw"], [5], None], 5) + b"hello")
    writer.write(encode_frame(["get", 8, ["raw"], [], 1.0]))
    while len(responses) < 2:
        fr.feed(await reader.read(4096))
    assert responses == [([7, "ok", [], None], b""), ([8, "ok", [5], None], b"hello")]
    writer.close()


async def test_standalone_server_and_timeouts() -> None:
    async with StoreServer("127.0.0.1", 0, secret=b"") as server:
        assert "serving" in repr(server)
        client = TCPStore("127.0.0.1", server.port, timeout=0.2, secret=b"")
        t0 = time.monotonic()
        with pytest.raises(DistTimeoutError, match=f"'absent'.*127.0.0.1:{server.port}"):
            await client.get("absent")
        assert 0.18 <= time.monotonic() - t0 < 1.0
        await client.aclose()
    with pytest.raises(DistStoreError):
        await server.start()


async def test_closing_while_connecting_stops_the_retries() -> None:
    client = TCPStore("127.0.0.1", free_port(), timeout=10, secret=SECRET)
    getter = asyncio.create_task(client.get("k"))
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    await client.aclose()
    with pytest.raises(DistStoreError, match="closed"):
        await asyncio.wait_for(getter, 3)
    assert time.monotonic() - t0 < 1.5
