"""The compiled ring and its Python twin: the same bytes in, the same answers and errors out.

``aiodist.transport._shm_ring`` is built by ``pip install`` (setup.py); CI checks that it was
(``AIODIST_NATIVE=1``: its absence fails here then), elsewhere its absence is a skip that names
the cause, never a pass.
Each test runs the same operations on a Python pair of rings and a compiled pair over segments
of their own and compares everything: what each call returns, the errors, and the segments'
bytes. Mixed pairs (one end compiled, the other Python, as when ``AIODIST_NATIVE`` differs
between two processes) must interoperate.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aiodist.native as native
from aiodist.transport import shm_segment
from aiodist.transport.shm_segment import Ring, Segment, ring_type
from aiodist.wire import shm as wire_shm
from tests.support.native import compiled_or_skip


def _compiled() -> ModuleType:
    return compiled_or_skip("aiodist.transport._shm_ring")


@pytest.fixture
def compiled() -> ModuleType:
    return _compiled()


class _Pair:
    """A writer and a reader on one fresh segment, of the given ring types."""

    def __init__(self, writer_type: Any, reader_type: Any, capacity: int = 4096) -> None:
        self.seg = Segment.create("unittest", capacity=capacity)
        self.peer = Segment.attach(self.seg.name)
        self.w = writer_type(self.seg)
        self.r = reader_type(self.peer)

    def close(self) -> None:
        del self.w, self.r  # (the compiled ring holds the mapping while it lives)
        self.peer.close()
        self.seg.close()


@pytest.fixture
def pairs(compiled: ModuleType) -> Iterator[dict[str, _Pair]]:
    made = {
        "python": _Pair(Ring, Ring),
        "compiled": _Pair(compiled.Ring, compiled.Ring),
        "compiled writes": _Pair(compiled.Ring, Ring),
        "compiled reads": _Pair(Ring, compiled.Ring),
    }
    yield made
    for p in made.values():
        p.close()


def test_the_layout_is_the_python_ring_s(compiled: ModuleType) -> None:
    assert {
        "PREFIX_SIZE": wire_shm.RECORD.size,
        "ALIGN": wire_shm.ALIGN,
        "WRAP": wire_shm.WRAP,
        "W_HEAD": shm_segment.W_HEAD,
        "W_TAIL": shm_segment.W_TAIL,
        "W_SLEEPING": shm_segment.W_SLEEPING,
        "W_WAKE": shm_segment.W_WAKE,
    } == compiled.LAYOUT


def _outcome(fn: Any, *args: Any) -> Any:
    try:
        out = fn(*args)
    except ValueError as exc:
        return ("ValueError", str(exc))
    if isinstance(out, tuple):  # a record: compare its bytes
        head, payload, rlen = out
        return bytes(head), bytes(payload), rlen
    return out


# An operation: ("write", header length, payload length) or ("read", records to take at most).
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.integers(0, 40), st.integers(0, 1500)),
        st.tuples(st.just("read"), st.integers(1, 6)),
    ),
    max_size=120,
)


@settings(max_examples=60, deadline=None)
@given(ops=_ops)
def test_same_operations_same_answers_same_bytes(ops: list[tuple[Any, ...]]) -> None:
    compiled = _compiled()
    made = {
        "python": _Pair(Ring, Ring),
        "compiled": _Pair(compiled.Ring, compiled.Ring),
        "compiled writes": _Pair(compiled.Ring, Ring),
        "compiled reads": _Pair(Ring, compiled.Ring),
    }
    try:
        for i, op in enumerate(ops):
            answers = {}
            for name, p in made.items():
                if op[0] == "write":
                    header = bytes([i % 251]) * op[1]
                    payload = memoryview(bytes([(i + k) % 256 for k in range(op[2])]))
                    answers[name] = (p.w.try_write(header, payload), p.w.head, p.w.consumed())
                else:
                    got = []
                    for _ in range(op[1]):
                        rec = _outcome(p.r.peek)
                        got.append(rec)
                        if rec is None:
                            break
                        p.r.advance(rec[2])
                    answers[name] = (got, p.r.tail, p.r.pending())
            assert len(set(map(repr, answers.values()))) == 1, (op, answers)
        rings = {
            name: (bytes(p.seg.data), p.seg.words[shm_segment.W_HEAD], p.seg.words[shm_segment.W_TAIL])
            for name, p in made.items()
        }
        assert len(set(rings.values())) == 1
    finally:
        for p in made.values():
            p.close()


def _corrupt_cases() -> list[tuple[str, int, bytes]]:
    """(what, offset into the ring's data, bytes written there) after one record was written."""
    le = int.to_bytes
    return [
        ("record length not aligned", 0, le(5, 4, "little")),
        ("record length below the prefix", 0, le(0, 4, "little")),
        ("record length past the ring", 0, le(8192, 4, "little")),
        ("header past its record", 4, le(100, 4, "little")),
        ("payload past its record", 8, le(1 << 40, 8, "little")),
        ("payload length near 2**64", 8, le((1 << 64) - 8, 8, "little")),
    ]


@pytest.mark.parametrize("what,offset,raw", _corrupt_cases(), ids=[c[0] for c in _corrupt_cases()])
def test_nonsense_is_refused_alike(pairs: dict[str, _Pair], what: str, offset: int, raw: bytes) -> None:
    answers = {}
    for name, p in pairs.items():
        assert p.w.try_write(b"h", memoryview(b"abc"))
        p.seg.data[offset : offset + len(raw)] = raw
        answers[name] = _outcome(p.r.peek)
    assert len(set(map(repr, answers.values()))) == 1, answers
    assert answers["python"][0] == "ValueError", answers


def test_counters_out_of_range_are_refused_alike(pairs: dict[str, _Pair]) -> None:
    answers = {}
    for name, p in pairs.items():
        p.seg.words[shm_segment.W_HEAD] = 2 * 4096  # more written than the ring holds
        answers[name] = _outcome(p.r.peek)
    assert len(set(map(repr, answers.values()))) == 1, answers
    assert answers["python"] == ("ValueError", "ring counters out of range (head 8192, tail 0)")


def test_the_engine_follows_aiodist_native(monkeypatch: pytest.MonkeyPatch, compiled: ModuleType) -> None:
    for value, want in (("0", Ring), ("1", compiled.Ring), ("", compiled.Ring)):
        monkeypatch.setenv("AIODIST_NATIVE", value)
        monkeypatch.setattr(native, "_choice", None)
        monkeypatch.setattr(native, "_loaded", {})
        assert ring_type() is want, value


def test_aiodist_native_refuses_what_it_does_not_know(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiodist.errors import DistValueError

    monkeypatch.setenv("AIODIST_NATIVE", "fast")
    monkeypatch.setattr(native, "_choice", None)
    with pytest.raises(DistValueError, match="AIODIST_NATIVE must be 1, 0 or auto, got 'fast'"):
        native.choice()


def test_a_part_that_is_not_built_falls_back_or_raises_as_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiodist.errors import DistError

    missing = "aiodist.transport._no_such_part"
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_choice", "auto")
    assert native.compiled(missing) is None
    assert native.describe()[missing].startswith("python (not built")
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_choice", "on")
    with pytest.raises(DistError, match=r"AIODIST_NATIVE=1, but aiodist\.transport\._no_such_part cannot be"):
        native.compiled(missing)


class _Link:
    """Both directions between two processes' rings, as a link holds them: the sleeper reads
    ``inp`` and keeps its count in ``mine``; the writer writes ``out`` and sees ``mine`` as
    ``seen`` (a second mapping of the same segment)."""

    def __init__(self, compiled: ModuleType) -> None:
        self.a, self.b = Segment.create("unittest", capacity=4096), Segment.create("unittest", capacity=4096)
        self.a2, self.b2 = Segment.attach(self.a.name), Segment.attach(self.b.name)
        self.out, self.inp = compiled.Ring(self.a), compiled.Ring(self.a2)
        self.mine, self.seen = compiled.Ring(self.b), compiled.Ring(self.b2)

    def close(self) -> None:
        del self.out, self.inp, self.mine, self.seen
        for seg in (self.a2, self.b2, self.a, self.b):
            seg.close()


def test_a_sleeping_reader_is_woken_by_the_writer(compiled: ModuleType) -> None:
    """The futex path of a caller's thread (``shm_here.wait_here``): it sleeps until the writer
    wakes it, not until its time is up, and leaves no sleeper counted behind."""
    link = _Link(compiled)
    try:
        if not link.inp.can_sleep:
            pytest.skip("no futex here: sleep_pending returns at once")
        assert not link.seen.wake_sleepers()  # (nobody asleep: nothing to wake)
        result: dict[str, Any] = {}

        def sleep() -> None:
            t = time.monotonic()
            result["moved"] = link.inp.sleep_pending(link.mine, 30.0)
            result["slept"] = time.monotonic() - t

        sleeper = threading.Thread(target=sleep)
        sleeper.start()
        deadline = time.monotonic() + 10
        while not link.seen.words[shm_segment.W_SLEEPING] and time.monotonic() < deadline:
            time.sleep(0.001)
        assert link.out.try_write(b"header", memoryview(b"payload"))
        assert link.seen.wake_sleepers()
        sleeper.join(20)
        assert result["moved"] and result["slept"] < 10, result  # (woken: 30 s was its limit)
        assert link.mine.words[shm_segment.W_SLEEPING] == 0
        # A record already there: no sleep at all; none and no wake: back when its time is up.
        assert link.inp.sleep_pending(link.mine, 30.0)
        link.inp.advance(link.inp.peek()[2])
        t = time.monotonic()
        assert not link.inp.sleep_pending(link.mine, 0.05)
        assert time.monotonic() - t >= 0.04
    finally:
        link.close()
