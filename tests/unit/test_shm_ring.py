"""The shared-memory ring, segments and single-copy reads, in one process (no sockets).

A writer and a reader are two ``Ring`` objects over two mappings of one segment, as in two
processes: what one publishes the other sees through the shared words only.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from aiodist.transport import shm_segment
from aiodist.transport.shm_segment import Doorbell, Ring, Segment, address_of, cma_read, sweep, unlink_name
from aiodist.wire.frames import ProtocolError
from aiodist.wire.shm import (
    BIN_DATA,
    BIN_TAG,
    DATA,
    DESC,
    DROP,
    MAX_SHAPES,
    MORE,
    PART,
    SHAPE,
    ShapeReader,
    ShapeWriter,
    ShmAccept,
    ShmBell,
    ShmDecline,
    ShmHello,
    ShmOffer,
    ShmStart,
    decode_record_header,
    decode_shm,
    record_size,
)


@pytest.fixture
def pair() -> Iterator[tuple[Segment, Segment]]:
    seg = Segment.create("unittest", capacity=4096)
    peer = Segment.attach(seg.name)
    yield seg, peer
    peer.close()
    seg.close()


def _payload(n: int, seed: int) -> memoryview:
    return memoryview(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes())


def test_segment_is_private_and_unguessable(pair: tuple[Segment, Segment]) -> None:
    seg, _ = pair
    path = os.path.join(shm_segment.SEGMENT_DIR, seg.name)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    prefix = "aiodist-unittest-"
    assert seg.name.startswith(prefix) and len(seg.name) - len(prefix) == 32  # 128 random bits
    other = Segment.create("unittest", capacity=4096)
    other.close()
    assert other.name != seg.name


def test_unlink_leaves_the_mapping(pair: tuple[Segment, Segment]) -> None:
    seg, peer = pair
    seg.unlink()
    assert seg.name not in os.listdir(shm_segment.SEGMENT_DIR)
    w, r = Ring(seg), Ring(peer)
    assert w.try_write(b"h", memoryview(b"after unlink"))
    rec = r.peek()
    assert rec is not None and bytes(rec[1]) == b"after unlink"


def test_attach_refuses_what_is_not_a_segment(tmp_path: object) -> None:
    with pytest.raises(ValueError):
        Segment.attach("../etc/passwd")
    with pytest.raises(ValueError):
        Segment.attach("someone-else")
    with pytest.raises(FileNotFoundError):
        Segment.attach("aiodist-unittest-" + "0" * 32)


@pytest.mark.parametrize("size", [0, 1, 7, 15, 16, 17, 1000, 2047 - 16 - 1])
def test_sizes_round_trip(pair: tuple[Segment, Segment], size: int) -> None:
    w, r = Ring(pair[0]), Ring(pair[1])
    data = _payload(size, size)
    assert w.try_write(b"hdr", data)
    rec = r.peek()
    assert rec is not None
    head, payload, rlen = rec
    assert bytes(head) == b"hdr" and bytes(payload) == bytes(data)
    assert rlen == record_size(3, size) and rlen % 16 == 0
    r.advance(rlen)
    assert r.peek() is None and not r.pending()


def test_wraparound_keeps_order_and_bytes(pair: tuple[Segment, Segment]) -> None:
    w, r = Ring(pair[0]), Ring(pair[1])
    sent = received = 0
    # Odd sizes make records end everywhere in the ring; thousands of laps of a 4 KiB ring.
    for i in range(3000):
        data = _payload(1 + (i * 37) % 700, i)
        assert w.try_write(i.to_bytes(4, "little"), data)
        sent += 1
        if i % 3 == 2:  # the reader lags, then catches up
            while (rec := r.peek()) is not None:
                head, payload, rlen = rec
                k = int.from_bytes(bytes(head), "little")
                assert k == received and bytes(payload) == bytes(_payload(1 + (k * 37) % 700, k))
                r.advance(rlen)
                received += 1
    assert received == sent
    assert w.head > 100 * w.cap  # it really wrapped


def test_full_ring_refuses_then_takes_after_the_reader_frees(pair: tuple[Segment, Segment]) -> None:
    w, r = Ring(pair[0]), Ring(pair[1])
    chunk = _payload(1000, 1)
    written = 0
    while w.try_write(b"x", chunk):
        written += 1
    assert 1 <= written <= 4  # 4 KiB of ring, 1 KiB records
    head_before = w.head
    assert not w.try_write(b"x", chunk) and w.head == head_before  # nothing half-written
    rec = r.peek()
    assert rec is not None
    r.advance(rec[2])
    assert w.try_write(b"x", chunk)  # room again once the reader freed a record
    count = 0
    while (rec := r.peek()) is not None:
        assert bytes(rec[1]) == bytes(chunk)
        r.advance(rec[2])
        count += 1
    assert count == written


def test_a_record_larger_than_the_ring_never_fits(pair: tuple[Segment, Segment]) -> None:
    w = Ring(pair[0])
    assert not w.try_write(b"", _payload(4096, 0))
    assert w.max_record == 2048


def test_reader_rejects_nonsense(pair: tuple[Segment, Segment]) -> None:
    seg, peer = pair
    w, r = Ring(seg), Ring(peer)
    assert w.try_write(b"h", memoryview(b"abc"))
    seg.data[0:4] = (5).to_bytes(4, "little")  # a record length that is not aligned
    with pytest.raises(ValueError):
        r.peek()


def test_cma_reads_this_process_and_fails_cleanly_on_a_dead_one() -> None:
    src = np.arange(1 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    cma_read(os.getpid(), address_of(memoryview(src)), memoryview(dst))
    assert (src == dst).all()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with pytest.raises(OSError) as info:
        cma_read(child.pid, address_of(memoryview(src)), memoryview(dst))
    assert info.value.errno in (3, 1)  # ESRCH (gone), EPERM where the pid was reused


def test_sweep_removes_only_the_job_named() -> None:
    mine = Segment.create("sweepjob", capacity=4096)
    other = Segment.create("otherjob", capacity=4096)
    try:
        assert sweep("sweepjob") == [mine.name]
        assert other.name in os.listdir(shm_segment.SEGMENT_DIR)
    finally:
        mine.linked = False
        mine.close()
        other.close()


def test_setup_messages_round_trip() -> None:
    for msg in (
        ShmHello("host/boot", True),
        ShmOffer("aiodist-x-" + "a" * 32, b"n" * 16, 12, 1 << 40),
        ShmAccept(b"e" * 16, False),
        ShmAccept(b"e" * 16, True, "aiodist-x-bell-" + "b" * 32),
        ShmDecline("no", True),
        ShmStart(),
        ShmBell(),
    ):
        assert decode_shm(msg.encode()) == msg


@pytest.mark.parametrize(
    "bad",
    [
        None,
        [],
        ["offer", "../x", b"n" * 16, 1, 2],
        ["offer", "aiodist-x", b"short", 1, 2],
        ["accept", b"e" * 16, 1],
        ["accept", b"e" * 16, True, "../etc/passwd"],
        ["accept", b"e" * 16, True, 7],
        ["hello", 3, True],
        ["bell", 1],
        ["nonsense"],
    ],
)
def test_malformed_setup_messages_are_protocol_errors(bad: object) -> None:
    with pytest.raises(ProtocolError):
        decode_shm(bad)


def test_record_headers() -> None:
    assert decode_record_header([DATA, 1, 0, 5, None], 8).nbytes == 8
    d = decode_record_header([DESC, 1, 0, 5, ["all_reduce", 5], 1 << 26, 42, 4096], 0)
    assert (d.kind, d.key, d.nbytes, d.pid, d.addr) == (DESC, (1, 0, 5), 1 << 26, 42, 4096)
    assert decode_record_header([PART, 1, 1, 3, None, 1000], 256).nbytes == 1000
    assert decode_record_header([MORE], 256).kind == MORE
    assert decode_record_header([DROP], 0).kind == DROP
    for bad in (
        [DATA, 1, 0],
        [DESC, 1, 0, 5, None, 10, 1, 2],
        [PART, 1, 0, 5, None, 10],
        [9, 1, 2, 3, None],
        [DROP, 1],
    ):
        with pytest.raises(ProtocolError):
            decode_record_header(bad, 100 if bad[0] != DESC else 3)


def test_setup_messages_travel_as_peer_frames() -> None:
    from aiodist.wire.frames import FrameReader
    from aiodist.wire.messages import KIND_SHM, ShmFrame, decode, encode

    msgs = (ShmHello("h", False), ShmBell(), ShmDecline("why", False))
    got: list[object] = []
    reader = FrameReader(lambda h, n: None, lambda h, p: got.append(h))
    data = b"".join(encode(ShmFrame(m)) for m in msgs)
    assert reader.feed(data) == len(data)
    assert [decode(h, 0) for h in got] == [ShmFrame(m) for m in msgs]
    with pytest.raises(ProtocolError):
        decode([KIND_SHM, 0, 0, 0, ["bell"]], 8)  # no payload on these
    with pytest.raises(ProtocolError):
        decode([KIND_SHM, 0, 0, 0, ["ring"]], 0)


# -- binary headers of eager data records ----------------------------------------------------
def _pack(obj: object) -> bytes:
    import msgpack

    return bytes(msgpack.packb(obj, use_bin_type=True))


def _read(reader: ShapeReader, ring: Ring) -> list[tuple[object, object, bytes]]:
    """What the reading end makes of every record in ``ring``: (key, fingerprint, payload)."""
    from aiodist.wire.frames import DEFAULT_LIMITS, decode_header

    out = []
    while (rec := ring.peek()) is not None:
        head, payload, rlen = rec
        if head.nbytes == BIN_DATA.size and head[0] == BIN_TAG:
            key, fp = reader.data(head)
            out.append((key, fp, bytes(payload)))
        else:
            raw = decode_header(head, DEFAULT_LIMITS)
            if raw[0] == SHAPE:
                reader.define(raw)
            else:
                rh = decode_record_header(raw, payload.nbytes)
                out.append((rh.key, rh.fp, bytes(payload)))
        ring.advance(rlen)
    return out


def _write(writer: ShapeWriter, ring: Ring, key: tuple[int, int, int], fp: list[object] | None) -> bool:
    define, header = writer.header(key, fp)
    if define is not None:
        assert ring.try_write(define, memoryview(b""))
    return ring.try_write(header if header is not None else _pack([DATA, *key, fp]), memoryview(b"abcd"))


def test_binary_headers_carry_keys_and_fingerprints_exactly(pair: tuple[Segment, Segment]) -> None:
    w, r = Ring(pair[0]), Ring(pair[1])
    writer, reader = ShapeWriter(_pack), ShapeReader()
    sent = [
        ((0, 1, -5), ["send", "float32", 1]),  # point-to-point, a negative tag
        ((7 << 40, 0, 3), ["all_reduce", 3, "float32", 1, -1, "SUM", "main"]),
        ((7 << 40, 0, 4), ["all_reduce", 4, "float32", 1, -1, "SUM", "main"]),  # same shape
        ((7 << 40, 0, 5), ["broadcast", 5, "int64", 9, 1, None, "thread t"]),
        ((0, 1, 2), None),
        ((0, 1, 2), ["send", ["not", "hashable"], 1]),  # msgpack carries it
        (((1 << 63) + 5, 1, 1), ["send", "float32", 1]),  # beyond a signed 64-bit: msgpack too
    ]
    for key, fp in sent:
        assert _write(writer, w, key, fp)
    got = _read(reader, r)
    assert [(k, fp) for k, fp, _ in got] == [(tuple(k), fp) for k, fp in sent]
    assert all(payload == b"abcd" for _, _, payload in got)


def test_a_shape_is_defined_once_per_ring(pair: tuple[Segment, Segment]) -> None:
    writer = ShapeWriter(_pack)
    first = writer.header((0, 0, 1), ["all_reduce", 1, "float32", 1, -1, "SUM", "main"])
    again = writer.header((0, 0, 2), ["all_reduce", 2, "float32", 1, -1, "SUM", "main"])
    other = writer.header((0, 0, 3), ["all_reduce", 3, "float32", 2, -1, "SUM", "main"])
    assert first[0] is not None and again[0] is None and other[0] is not None
    assert all(h is not None and len(h) == BIN_DATA.size for _, h in (first, again, other))


def test_a_shape_that_found_no_room_is_defined_again() -> None:
    writer = ShapeWriter(_pack)
    fp = ["send", "float32", 4]
    define, _ = writer.header((0, 1, 0), fp)
    writer.forget_last()  # (its SHAPE record was not written)
    again, _ = writer.header((0, 1, 0), fp)
    assert define is not None and again == define  # the same number, defined this time


def test_past_max_shapes_fingerprints_travel_in_msgpack() -> None:
    writer = ShapeWriter(_pack)
    for i in range(MAX_SHAPES):
        assert writer.header((0, 1, 0), ["send", "float32", i])[1] is not None
    assert writer.header((0, 1, 0), ["send", "float32", MAX_SHAPES]) == (None, None)
    assert writer.header((0, 1, 0), ["send", "float32", 7])[0] is None  # known shapes still go


def test_reader_refuses_shapes_it_was_not_given() -> None:
    reader = ShapeReader()
    undefined = memoryview(BIN_DATA.pack(BIN_TAG, 1, 1, 0, 0, 0))
    with pytest.raises(ProtocolError, match="never defined"):
        reader.data(undefined)
    for bad in ([SHAPE, 2, ["send"]], [SHAPE, 1, "send"], [SHAPE, True, ["send"]], [SHAPE, 1]):
        with pytest.raises(ProtocolError):
            reader.define(bad)
    reader.define([SHAPE, 1, ["send", "float32", 1]])
    assert reader.data(undefined) == ((0, 1, 0), ["send", "float32", 1])


# -- doorbells -------------------------------------------------------------------------------
def test_a_doorbell_wakes_its_reader_and_leaves_no_name() -> None:
    name, reader = Doorbell.create("unittest")
    try:
        path = os.path.join(shm_segment.SEGMENT_DIR, name)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        writer = Doorbell.open(name)
        unlink_name(name)  # (the reader's part once the writer has it)
        assert not os.path.exists(path)
        for _ in range(100):  # more than the socket queues: the rest are pending wake-ups
            assert Doorbell.ring(writer)
        assert reader.recv(64) == b"\x01"
        while True:  # (one wake-up per call)
            try:
                reader.recv(64)
            except BlockingIOError:
                break
        Doorbell.take(reader)  # (none left: nothing raised)
        writer.close()
    finally:
        reader.close()


def test_a_doorbell_refuses_what_is_not_one() -> None:
    seg = Segment.create("unittest", capacity=4096)
    try:
        with pytest.raises(ValueError, match="not a private doorbell"):
            Doorbell.open(seg.name)  # (a file of this user, but not a socket)
    finally:
        seg.close()


def test_ringing_a_reader_that_has_gone_fails_softly_even_with_sigpipe_s_default() -> None:
    """A program may restore SIGPIPE's default action (many command-line tools do): ringing a
    doorbell whose reader has gone must then answer False, not kill the process."""
    code = (
        "import signal\n"
        "from aiodist.transport.shm_segment import Doorbell, unlink_name\n"
        "name, reader = Doorbell.create('unittest')\n"
        "writer = Doorbell.open(name)\n"
        "unlink_name(name)\n"
        "reader.close()\n"
        "signal.signal(signal.SIGPIPE, signal.SIG_DFL)\n"
        "print(Doorbell.ring(writer))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "False", (res.returncode, res.stderr)
