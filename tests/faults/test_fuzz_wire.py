"""Property-based fuzzing (hypothesis) of everything that decodes bytes from the network:
the frame reader, the store server (before and after authentication) and a peer port (after
authentication). The long-running coverage-guided targets live in ``fuzz/`` (atheris).

Properties: the frame reader either yields frames or raises ``ProtocolError`` (never another
exception, never a payload sink larger than the limits); the store server and the transport
never let an exception escape into the event loop, drop what they cannot parse, and keep
serving legitimate clients.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiodist.group import ProcessGroup
from aiodist.store import StoreServer, TCPStore
from aiodist.transport.tcp import TcpTransport
from aiodist.wire.frames import PREFIX, FrameReader, Limits, ProtocolError, encode_frame
from aiodist.wire.handshake import make_hello, parse_challenge, verify_welcome
from aiodist.wire.messages import KIND_ABORT, KIND_DATA, KIND_MISMATCH

pytestmark = pytest.mark.timeout(120)

SECRET = b"fuzz-secret"
SMALL = Limits(max_header=512, max_payload=4096, max_str=64, max_bin=64, max_array=16, max_map=4)

# msgpack values of every shape, nested a little
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=40),
)
values = st.recursive(
    leaves,
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=20,
)


@st.composite
def frame_streams(draw: st.DrawFn) -> bytes:
    """Valid frames, mutated frames and raw garbage, concatenated."""
    parts = []
    for _ in range(draw(st.integers(1, 6))):
        choice = draw(st.integers(0, 3))
        if choice == 0:
            payload = draw(st.binary(max_size=300))
            parts.append(encode_frame(draw(values), len(payload)) + payload)
        elif choice == 1:
            hlen = draw(st.integers(0, 2**32 - 1))
            plen = draw(st.integers(0, 2**64 - 1))
            parts.append(PREFIX.pack(hlen, plen) + draw(st.binary(max_size=64)))
        elif choice == 2:
            good = bytearray(encode_frame(draw(values), 3) + b"abc")
            for _ in range(draw(st.integers(1, 4))):
                good[draw(st.integers(0, len(good) - 1))] = draw(st.integers(0, 255))
            parts.append(bytes(good))
        else:
            parts.append(draw(st.binary(max_size=200)))
    return b"".join(parts)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frame_streams(), st.lists(st.integers(1, 64), min_size=1, max_size=8), st.booleans())
def test_frame_reader_yields_frames_or_a_protocol_error(data: bytes, cuts: list[int], sink: bool) -> None:
    announced: list[int] = []

    def on_header(header: Any, n: int) -> memoryview | None:
        announced.append(n)
        assert n <= SMALL.max_payload
        return memoryview(bytearray(n)) if sink else None

    frames: list[Any] = []
    reader = FrameReader(on_header, lambda h, p: frames.append((h, bytes(p))), SMALL, scratch_size=128)
    pos, i = 0, 0
    try:
        while pos < len(data):
            n = cuts[i % len(cuts)]
            reader.feed(data[pos : pos + n])
            pos += n
            i += 1
    except ProtocolError:
        return
    assert len(frames) <= len(announced)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1))
def test_announced_sizes_are_checked_before_anything_is_stored(hlen: int, plen: int) -> None:
    reader = FrameReader(lambda h, n: None, lambda h, p: None, SMALL, scratch_size=64)
    over = hlen > SMALL.max_header or plen > SMALL.max_payload
    try:
        reader.feed(PREFIX.pack(hlen, plen))
    except ProtocolError as exc:
        assert ("exceeds the limit" in str(exc)) == over, exc
        assert over or hlen == 0  # (an empty header is not msgpack)
    else:
        assert not over


# -- the store server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    errors: list[Any] = []
    lp.set_exception_handler(lambda _lp, ctx: errors.append(ctx))
    lp.errors = errors  # type: ignore[attr-defined]
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def store_server(loop: asyncio.AbstractEventLoop) -> Iterator[StoreServer]:
    server = StoreServer("127.0.0.1", 0, secret=SECRET, handshake_timeout=0.3)
    loop.run_until_complete(server.start())
    yield server
    loop.run_until_complete(server.aclose())


async def _authenticated(port: int, job: str, rank: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got: list[Any] = []
    fr = FrameReader(lambda h, n: None, lambda h, p: got.append(h))

    async def next_message() -> Any:
        while not got:
            data = await reader.read(4096)
            assert data, "closed during the handshake"
            fr.feed(data)
        return got.pop(0)

    challenge = parse_challenge(await next_message())
    hello = make_hello(challenge, job, rank, SECRET)
    writer.write(encode_frame(hello.pack()))
    verify_welcome(challenge, hello, await next_message(), job, SECRET)
    return reader, writer


async def _drain(reader: asyncio.StreamReader, seconds: float) -> bytes:
    out = b""
    try:
        async with asyncio.timeout(seconds):
            while chunk := await reader.read(65536):
                out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


OPS = ["set", "get", "add", "compare_set", "wait", "check", "delete_key", "num_keys", "append", "multi_get",
       "multi_set", "cancel", "explode"]  # fmt: skip


@st.composite
def store_requests(draw: st.DrawFn) -> bytes:
    out = []
    for _ in range(draw(st.integers(1, 4))):
        keys = draw(st.lists(st.one_of(st.text(max_size=8), values), max_size=4))
        payload = draw(st.binary(max_size=64))
        lens = draw(st.one_of(st.just([len(payload)]), st.lists(st.integers(-5, 100), max_size=4), values))
        arg = draw(st.one_of(st.floats(min_value=0, max_value=0.05), values))
        header = [draw(st.sampled_from(OPS) | values), draw(st.integers(0, 50) | values), keys, lens, arg]
        if draw(st.booleans()):
            header = draw(st.lists(values, max_size=6))
        out.append(encode_frame(header, len(payload)) + payload)
    return b"".join(out)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(store_requests(), st.booleans())
def test_store_server_survives_any_request(
    loop: asyncio.AbstractEventLoop, store_server: StoreServer, blob: bytes, authenticate: bool
) -> None:
    async def go() -> None:
        if authenticate:
            reader, writer = await _authenticated(store_server.port, "aiodist-store", -1)
        else:
            reader, writer = await asyncio.open_connection("127.0.0.1", store_server.port)
        writer.write(blob)
        await _drain(reader, 0.1)
        writer.close()
        async with TCPStore("127.0.0.1", store_server.port, timeout=5, secret=SECRET) as client:
            await client.set("alive", b"yes")
            assert await client.get("alive") == b"yes"

    loop.run_until_complete(go())
    assert not loop.errors, loop.errors  # type: ignore[attr-defined]


def test_store_server_fuzz_left_nothing_behind(
    loop: asyncio.AbstractEventLoop, store_server: StoreServer
) -> None:
    async def settle() -> None:
        for _ in range(100):
            if store_server.num_connections == 0:
                return
            await asyncio.sleep(0.05)

    loop.run_until_complete(settle())
    assert store_server.num_connections == 0


# -- a peer port, after authentication ------------------------------------------------------------
@st.composite
def peer_frames(draw: st.DrawFn) -> bytes:
    out = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from([KIND_DATA, KIND_MISMATCH, KIND_ABORT, 3, 7]) | values)
        key = [draw(st.integers(-2, 2) | values) for _ in range(3)]
        fp = draw(values)
        n = draw(st.integers(0, 64))
        header = [kind, *key, fp] if draw(st.booleans()) else draw(values)
        frame = encode_frame(header, n) + draw(st.binary(min_size=n, max_size=n))
        if draw(st.booleans()):
            frame = bytes(draw(st.integers(0, 255)) if i == draw(st.integers(0, len(frame) - 1)) else b
                          for i, b in enumerate(frame))  # fmt: skip
        out.append(frame)
    return b"".join(out)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(peer_frames())
def test_peer_port_survives_any_authenticated_frame(loop: asyncio.AbstractEventLoop, blob: bytes) -> None:
    async def go() -> None:
        t0 = TcpTransport(0, 3, job="fuzz/1", secret=SECRET)
        t2 = TcpTransport(2, 3, job="fuzz/1", secret=SECRET)
        try:
            port = await t0.listen("127.0.0.1")
            await t2.listen("127.0.0.1")
            await t2.connect(0, "127.0.0.1", port, 5.0)
            reader, writer = await _authenticated(port, "fuzz/1", 1)
            writer.write(blob)
            await _drain(reader, 0.05)
            writer.close()
            # whatever rank 1 did, ranks 0 and 2 still talk
            g0 = ProcessGroup(t0, [0, 2], 1, timeout=5)
            g2 = ProcessGroup(t2, [0, 2], 1, timeout=5)
            x = np.zeros(3, np.int64)
            w = g0.recv(x, 2, tag=11)
            await g2.send(np.array([1, 2, 3], np.int64), 0, tag=11)
            await w
            assert x.tolist() == [1, 2, 3]
        finally:
            t0.abort()
            t2.abort()

    loop.run_until_complete(go())
    assert not loop.errors, loop.errors  # type: ignore[attr-defined]


def test_msgpack_limits_apply_to_every_header() -> None:
    """A header within the byte limit but with too many items is refused, not built."""
    many = msgpack.packb(list(range(5000)))
    reader = FrameReader(lambda h, n: None, lambda h, p: None, Limits(max_header=1 << 20, max_array=4096))
    with pytest.raises(ProtocolError):
        reader.feed(struct.pack("!IQ", len(many), 0) + many)
