"""The compiled eager reader and its Python twin: the same ring, the same receives, the same outcome.

``take_eager`` takes the eager messages at the front of a shared-memory ring whose receives are
posted, and stops at anything else, which the link's general reader takes. Hypothesis writes
the same random records into two rings (eager messages with binary headers and their shapes,
fingerprints only msgpack can carry, records of other kinds) and posts the same receives (for
this sender or any, of the right size or not, agreeing or disagreeing fingerprints); one ring is
read by the Python twins (ring, mailbox, reader), the other by the compiled ones, with the same
stand-in for the general reader. Everything observable must be equal: what each call returned,
the receives' outcomes and errors, the buffers, the held bytes and where each ring's reader is.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodist.errors import CollectiveMismatchError
from aiodist.transport import matching, shm_eager
from aiodist.transport.shm_segment import Ring, Segment
from aiodist.wire.frames import DEFAULT_LIMITS, decode_header
from aiodist.wire.shm import DATA, SHAPE, ShapeReader, ShapeWriter, decode_record_header
from tests.support.native import compiled_or_skip

pytestmark = pytest.mark.unit

PEER = 1
KEYS = [(0, 1, 0), (0, 1, 7), (2, 0, 3)]
FPS: list[Any] = [
    None,
    ["send", "float32", 2],
    ["send", "int64", 1],
    ["all_reduce", 3, "float32", 2, "sum", None, "main.py:3"],
    ["send", {"not": "hashable"}, 2],  # (no shape can carry it: a msgpack header)
]

WRITE = st.tuples(
    st.just("write"), st.integers(0, 2), st.sampled_from([1, 1, 1, 0, 2, 3, 4]), st.sampled_from([8, 8, 4, 0])
)
POST = st.tuples(
    st.just("post"),
    st.sampled_from([PEER, PEER, None, 2]),
    st.integers(0, 2),
    st.sampled_from([1, 1, 0, 2, 3]),
    st.sampled_from([8, 8, 4, 0]),
)
READ = st.tuples(st.just("read"))
OTHER = st.tuples(st.just("other"))  # a record of another kind: the general reader's


def _outcome(fut: asyncio.Future[int]) -> Any:
    if not fut.done():
        return "pending"
    exc = fut.exception()
    return ("error", type(exc).__name__, str(exc)) if exc is not None else ("ok", fut.result())


def _general(ring: Any, shapes: ShapeReader, box: Any) -> Any:
    """A stand-in for the link's general reader: one record, as ``ShmLink._take`` would take
    it when there is room (a shape defined, a message held or delivered)."""
    rec = ring.peek()
    if rec is None:
        return None
    raw, payload, rlen = rec
    if raw.nbytes == 32 and raw[0] == 1:
        key, fp = shapes.data(raw)
    else:
        decoded = decode_header(raw, DEFAULT_LIMITS)
        if decoded[0] == SHAPE:
            shapes.define(decoded)
            ring.advance(rlen)
            return "shape"
        rh = decode_record_header(decoded, payload.nbytes)
        key, fp = rh.key, rh.fp
    box.deliver(PEER, key, fp, payload, owned=False)
    ring.advance(rlen)
    return "general"


def _run(ring_type: Any, mailbox_type: Any, take: Any, ops: list[tuple[Any, ...]]) -> list[Any]:
    async def main() -> list[Any]:
        seg = Segment.create("unittest", capacity=1 << 16)
        peer = Segment.attach(seg.name)
        try:
            return _program(ring_type(seg), Ring(peer), mailbox_type, take, ops)
        finally:
            peer.close()
            seg.close()

    return asyncio.run(main())


def _program(
    reader: Any, writer: Ring, mailbox_type: Any, take: Any, ops: list[tuple[Any, ...]]
) -> list[Any]:
    trace: list[Any] = []
    box = mailbox_type(
        0, asyncio.get_running_loop(), 1 << 20, lambda *a: trace.append(("mismatch", a[0], a[1]))
    )
    shapes_out, shapes_in = ShapeWriter(msgpack.packb), ShapeReader()
    futures, bufs = [], []
    for step, op in enumerate(ops):
        if op[0] == "write":
            _, k, f, size = op
            key, fp = KEYS[k], FPS[f]
            define, header = shapes_out.header(key, fp)
            if define is not None:
                writer.try_write(define, memoryview(b""))
            if header is None:
                header = msgpack.packb([DATA, *key, fp])
            writer.try_write(header, memoryview(bytes([step % 251]) * size))
        elif op[0] == "other":
            writer.try_write(msgpack.packb([DATA, 9, 1, 9, None]), memoryview(b"x"))
        elif op[0] == "post":
            _, src, k, f, size = op
            buf = memoryview(bytearray(size))
            bufs.append(buf)
            futures.append(box.post(src, KEYS[k], buf, FPS[f]))
        else:
            while True:
                trace.append(take(reader, shapes_in, box, PEER))
                done = _general(reader, shapes_in, box)
                trace.append(done)
                if done is None:
                    break
        trace.append((step, box.unexpected_bytes, reader.tail, [_outcome(f) for f in futures]))
    trace.append([bytes(b) for b in bufs])
    return trace


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(WRITE, WRITE, POST, POST, READ, OTHER), max_size=40))
def test_same_records_same_deliveries(ops: list[tuple[Any, ...]]) -> None:
    ring = compiled_or_skip("aiodist.transport._shm_ring")
    box = compiled_or_skip("aiodist.transport._matching")
    eager = compiled_or_skip("aiodist.transport._shm_eager")
    ops = [*ops, ("read",)]
    python = _run(Ring, matching.Mailbox, shm_eager.take_eager, ops)
    assert _run(ring.Ring, box.Mailbox, eager.take_eager, ops) == python


def test_it_takes_what_is_posted_and_stops_at_the_rest() -> None:
    """Both twins: eager messages into their receives, in order; a message with no receive
    stops the reader there (it is the general reader's to hold); a size that disagrees fails
    its receive and drops the message, as the general reader would."""
    ring = compiled_or_skip("aiodist.transport._shm_ring")
    box = compiled_or_skip("aiodist.transport._matching")
    eager = compiled_or_skip("aiodist.transport._shm_eager")
    for twins in ((Ring, matching.Mailbox, shm_eager.take_eager), (ring.Ring, box.Mailbox, eager.take_eager)):
        ops: list[tuple[Any, ...]] = [
            ("post", PEER, 0, 1, 8),
            ("post", PEER, 0, 1, 4),
            ("write", 0, 1, 8),
            ("write", 0, 1, 8),  # (into the 4-byte receive: refused)
            ("write", 1, 1, 8),  # (no receive: held by the general reader)
            ("read",),
        ]
        trace = _run(*twins, ops)
        assert trace[5:7] == [(0, 0), "shape"]  # (a shape's definition is the general reader's)
        assert trace[7] == (2, 8)  # then it took the first two (one delivered)
        assert trace[8] == "general"  # the third went the general way, and was held
        outcomes = trace[-2][3]
        assert outcomes[0] == ("ok", PEER)
        assert outcomes[1][:2] == ("error", CollectiveMismatchError.__name__)
        assert trace[-2][1] == 8  # (held)
        assert trace[-1][0] == bytes([2]) * 8


WRITE_KEYS = [(0, 1, 0), (5, 0, 3), (1 << 63, 0, 1), (0, 1, -(1 << 63)), (0, 300, 0)]
WRITE_FPS: list[Any] = [
    None,
    ["send", "float32", 2],
    ["all_reduce", 3, "float32", 2, "sum", None, "main.py:3"],
    ["all_reduce", True, "float32", 2, "sum", None, "main.py:3"],
    ["all_reduce", 1 << 63, "float32", 2, "sum", None, "main.py:3"],
    ["send", ["a", "list"], 2],  # (unhashable)
]


def _write_program(ring_type: Any, write: Any, ops: list[tuple[int, int, int]]) -> tuple[list[Any], bytes]:
    """Write the records of ``ops`` the way ``ShmLink.send`` does (the eager writer, else the
    general way); the returns and the ring's bytes."""
    seg = Segment.create("unittest", capacity=4096)
    try:
        ring = ring_type(seg)
        shapes = ShapeWriter(msgpack.packb)
        said = []
        for k, f, size in ops:
            key, fp, payload = WRITE_KEYS[k], WRITE_FPS[f], memoryview(bytes([size % 251]) * size)
            wrote = write(ring, shapes, key, fp, payload)
            said.append(wrote)
            if wrote < 0:  # (ShmLink._write_data)
                define, header = shapes.header(key, fp)
                if define is not None and not ring.try_write(define, memoryview(b"")):
                    shapes.forget_last()
                    said.append("no room for the shape")
                    continue
                said.append(ring.try_write(header or msgpack.packb([DATA, *key, fp]), payload))
        del ring
        return said, bytes(seg.data)
    finally:
        seg.close()


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, len(WRITE_KEYS) - 1),
            st.integers(0, len(WRITE_FPS) - 1),
            st.sampled_from([0, 8, 8, 200, 700]),
        ),
        max_size=30,
    )
)
def test_same_writes_same_bytes(ops: list[tuple[int, int, int]]) -> None:
    ring = compiled_or_skip("aiodist.transport._shm_ring")
    eager = compiled_or_skip("aiodist.transport._shm_eager")
    python = _write_program(Ring, shm_eager.write_eager, ops)
    assert _write_program(ring.Ring, eager.write_eager, ops) == python
    # (and a program of them does run the eager writer: a known shape, room in the ring)
    if ops and WRITE_FPS[ops[0][1]] is None and ops[0][0] < 2 and ops[0][2] < 700:
        assert python[0][0] == 1
