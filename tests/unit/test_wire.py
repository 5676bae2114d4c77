"""The sans-IO wire: frames fed in every possible split, limits, malformed input, handshake."""

from __future__ import annotations

import os
import struct
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodist.wire import FrameReader, Limits, ProtocolError, encode_frame
from aiodist.wire import handshake as hs
from aiodist.wire.frames import PREFIX, SKIP


def _frames() -> tuple[bytes, list[tuple[Any, bytes]]]:
    msgs = [([0, 1, 2, i, ["all_reduce", i, "float32", i, -1, "SUM"]], os.urandom(i * 37)) for i in range(6)]
    msgs.append((["challenge", 1, b"x" * 16], b""))
    data = b"".join(encode_frame(h, len(p)) + p for h, p in msgs)
    return data, msgs


class Collector:
    def __init__(self, into_buffers: bool) -> None:
        self.frames: list[tuple[Any, bytes]] = []
        self.into_buffers = into_buffers
        self.sinks: list[bytearray] = []

    def on_header(self, header: Any, n: int) -> memoryview | None:
        if not self.into_buffers:
            return None
        buf = bytearray(n)
        self.sinks.append(buf)
        return memoryview(buf)

    def on_frame(self, header: Any, payload: memoryview) -> None:
        self.frames.append((header, bytes(payload)))


class Skipper(Collector):
    def __init__(self, into_buffers: bool, skip: set[int]) -> None:
        super().__init__(into_buffers)
        self.skip = skip
        self.seen = 0

    def on_header(self, header: Any, n: int) -> memoryview | None:
        self.seen += 1
        return SKIP if self.seen - 1 in self.skip else super().on_header(header, n)


@pytest.mark.parametrize("into_buffers", [False, True])
def test_every_two_way_split(into_buffers: bool) -> None:
    data, msgs = _frames()
    for cut in range(len(data) + 1):
        c = Collector(into_buffers)
        r = FrameReader(c.on_header, c.on_frame)
        r.feed(data[:cut])
        r.feed(data[cut:])
        assert c.frames == msgs, f"split at {cut}"
        assert not r.mid_frame


def test_byte_at_a_time_and_small_scratch() -> None:
    data, msgs = _frames()
    c = Collector(True)
    r = FrameReader(c.on_header, c.on_frame, scratch_size=64)
    for i in range(len(data)):
        r.feed(data[i : i + 1])
    assert c.frames == msgs


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=97), min_size=1, max_size=40), st.booleans())
def test_random_chunking(chunks: list[int], into_buffers: bool) -> None:
    data, msgs = _frames()
    c = Collector(into_buffers)
    r = FrameReader(c.on_header, c.on_frame, scratch_size=128)
    pos, i = 0, 0
    while pos < len(data):
        n = chunks[i % len(chunks)]
        r.feed(data[pos : pos + n])
        pos += n
        i += 1
    assert c.frames == msgs


def test_payload_lands_in_posted_buffer_without_scratch() -> None:
    """With get_buffer/buffer_updated, a posted payload is written straight into its sink."""
    payload = os.urandom(1 << 20)
    sink = bytearray(len(payload))
    got: list[Any] = []
    r = FrameReader(lambda h, n: memoryview(sink), lambda h, p: got.append(h), scratch_size=4096)
    data = encode_frame(["x"], len(payload)) + payload
    pos = 0
    direct = 0
    while pos < len(data):
        buf = r.get_buffer()
        if buf.obj is sink:
            direct += 1
        n = min(len(buf), len(data) - pos)
        buf[:n] = data[pos : pos + n]
        r.buffer_updated(n)
        pos += n
    assert got == [["x"]] and bytes(sink) == payload
    assert direct > 0


@pytest.mark.parametrize("into_buffers", [False, True])
def test_skipped_payloads_are_read_and_dropped_at_every_split(into_buffers: bool) -> None:
    """SKIP reads a payload without a buffer of its size; the frames around it are intact."""
    data, msgs = _frames()
    skip = {2, 4}  # frames whose payload nobody wants
    want = [(h, b"" if i in skip else p) for i, (h, p) in enumerate(msgs)]
    for cut in range(0, len(data) + 1, 7):
        c = Skipper(into_buffers, skip)
        r = FrameReader(c.on_header, c.on_frame, scratch_size=64)
        r.feed(data[:cut])
        r.feed(data[cut:])
        assert c.frames == want, f"split at {cut}"


@pytest.mark.parametrize("to", ["buffer", "nowhere"])
def test_a_payload_redirected_midway_keeps_what_came_and_sends_the_rest_on(to: str) -> None:
    """A receive abandoned while its payload streams in: the rest goes elsewhere (a held buffer,
    with the first part copied into it) or nowhere; its first buffer gets nothing more."""
    payload = os.urandom(100_000)
    first, second = bytearray(len(payload)), bytearray(len(payload))
    got: list[bytes] = []
    r = FrameReader(
        lambda h, n: memoryview(first) if n == len(first) else None,
        lambda h, p: got.append(bytes(p)),
        scratch_size=4096,
    )
    data = encode_frame(["x"], len(payload)) + payload + encode_frame(["after"], 3) + b"abc"
    half = len(data) // 2
    r.feed(data[:half])
    assert r.receiving_payload
    before = bytes(first)
    r.redirect(memoryview(second) if to == "buffer" else None)
    r.feed(data[half:])
    assert bytes(first) == before  # nothing more landed in the abandoned receive's buffer
    if to == "buffer":
        assert got[0] == payload and bytes(second) == payload
    else:
        assert got[0] == b""
    assert got[1] == b"abc"


def test_mid_frame_reported() -> None:
    r = FrameReader(lambda h, n: None, lambda h, p: None)
    data = encode_frame([1], 10) + b"12345"
    r.feed(data)
    assert r.mid_frame


@pytest.mark.parametrize(
    "blob",
    [
        PREFIX.pack(1 << 30, 0),  # huge header announced
        PREFIX.pack(4, 1 << 62) + msgpack.packb([1, 2]),  # 2**62-byte payload announced
        PREFIX.pack(3, 0) + b"\xc1\xc1\xc1",  # invalid msgpack
        PREFIX.pack(2, 0) + b"\x92\x01",  # truncated array inside a complete header
    ],
)
def test_malformed_input_is_a_protocol_error(blob: bytes) -> None:
    r = FrameReader(lambda h, n: None, lambda h, p: None, Limits(max_payload=1 << 30))
    with pytest.raises(ProtocolError):
        r.feed(blob)


def test_deeply_nested_header_is_refused() -> None:
    nested = b"\x91" * 100_000 + b"\x00"
    r = FrameReader(lambda h, n: None, lambda h, p: None, Limits(max_header=1 << 20))
    with pytest.raises(ProtocolError):
        r.feed(struct.pack("!IQ", len(nested), 0) + nested)


def test_oversized_string_in_header_is_refused() -> None:
    r = FrameReader(lambda h, n: None, lambda h, p: None, Limits(max_str=10))
    with pytest.raises(ProtocolError):
        r.feed(encode_frame(["x" * 100]))


# -- handshake ---------------------------------------------------------------------------


def _roundtrip(secret_a: bytes | None, secret_c: bytes | None, job_a: str = "j", job_c: str = "j") -> int:
    ch = hs.make_challenge()
    ch2 = hs.parse_challenge(msgpack.unpackb(msgpack.packb(ch.pack())))
    hello = hs.make_hello(ch2, job_c, 3, secret_c)
    accepted = hs.accept_hello(ch, msgpack.unpackb(msgpack.packb(hello.pack())), job_a, secret_a)
    welcome = hs.make_welcome(ch, accepted, job_a, 0, secret_a)
    return hs.verify_welcome(ch2, hello, msgpack.unpackb(msgpack.packb(welcome.pack())), job_c, secret_c).rank


def test_handshake_with_and_without_secret() -> None:
    assert _roundtrip(None, None) == 0
    assert _roundtrip(b"s3cret", b"s3cret") == 0


@pytest.mark.parametrize(("a", "c"), [(b"right", b"wrong"), (b"right", None), (None, b"extra")])
def test_handshake_wrong_secret_refused(a: bytes | None, c: bytes | None) -> None:
    with pytest.raises(hs.AuthError):
        _roundtrip(a, c)


def test_handshake_other_job_refused() -> None:
    with pytest.raises(hs.AuthError, match="job"):
        _roundtrip(b"k", b"k", job_a="one", job_c="two")


def test_replayed_hello_refused() -> None:
    """A hello recorded from one connection does not verify against a fresh challenge."""
    ch = hs.make_challenge()
    hello = hs.make_hello(ch, "j", 1, b"k")
    hs.accept_hello(ch, hello.pack(), "j", b"k")
    with pytest.raises(hs.AuthError):
        hs.accept_hello(hs.make_challenge(), hello.pack(), "j", b"k")


def test_forged_welcome_refused() -> None:
    ch = hs.make_challenge()
    hello = hs.make_hello(ch, "j", 1, b"k")
    forged = hs.make_welcome(ch, hello, "j", 0, b"not-the-secret")
    with pytest.raises(hs.AuthError):
        hs.verify_welcome(ch, hello, forged.pack(), "j", b"k")


def test_version_mismatch() -> None:
    with pytest.raises(ProtocolError, match="version"):
        hs.parse_challenge(["challenge", 999, b"x" * 16])
