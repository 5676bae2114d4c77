"""The compiled matcher and its Python twin: the same posts and arrivals, the same outcomes.

``aiodist.transport._matching`` is built by ``pip install`` (setup.py); CI checks that it was
(``AIODIST_NATIVE=1``: its absence fails here then), elsewhere its absence is a skip that names
the cause, never a pass.
Hypothesis drives both mailboxes through the same random programs (receives posted for one
sender or any, messages arriving and held, withdrawals, abandoned and failed operations, dead
peers, floors, finished collectives, fingerprints that agree or not, sizes that fit or not) and
the test demands the same trace: what each call returned, every future's outcome and error text,
the buffers' bytes, the callbacks made and the unexpected bytes counted.
"""

from __future__ import annotations

import asyncio
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aiodist.native as native
from aiodist.errors import DistNetworkError
from aiodist.transport import matching
from aiodist.transport.matching import COLL, DISCARD, P2P
from tests.support.native import compiled_or_skip

pytestmark = pytest.mark.unit


def _compiled() -> ModuleType:
    return compiled_or_skip("aiodist.transport._matching")


KEYS = [(0, P2P, 0), (0, P2P, 5), (0, COLL, 1), (0, COLL, 2), (3, COLL, 0)]
FPS: list[Any] = [
    None,
    ["send", "float32", 2],
    ["send", "int64", 1],
    ("send", "float32", 2),  # (a tuple equal to a list: msgpack's and the shapes' forms)
    ["all_reduce", 1, "float32", 2, "sum", None, "main.py:3"],
    ["all_reduce", 1, "float32", 2, "sum", None, "other.py:9"],
]
SRCS = st.sampled_from([None, 1, 1, 1, 2])
PEERS = st.sampled_from([1, 1, 1, 2])
# (mostly the first two keys and one sender: most programs then have receives and messages meet)
KEY = st.sampled_from([0, 0, 0, 1, 1, 2, 3, 4])
FP = st.sampled_from([1, 1, 1, 0, 2, 3, 4, 5])
SIZE = st.sampled_from([0, 8, 8, 8, 4])

OPS = st.one_of(
    st.tuples(st.just("post"), SRCS, KEY, SIZE, FP),
    st.tuples(st.just("post"), SRCS, KEY, SIZE, FP),
    st.tuples(st.just("deliver"), PEERS, KEY, SIZE, FP, st.booleans()),
    st.tuples(st.just("match"), PEERS, KEY, SIZE, FP),
    st.tuples(st.just("match"), PEERS, KEY, SIZE, FP),
    st.tuples(st.just("complete"), st.integers(0, 7)),
    st.tuples(st.just("repost"), st.integers(0, 7)),
    st.tuples(st.just("cancel"), st.integers(0, 15)),
    st.tuples(st.just("finish"), KEY),
    st.tuples(st.just("abandon"), KEY),
    st.tuples(st.just("set_floor"), st.sampled_from([0, 3]), st.integers(0, 3)),
    st.tuples(st.just("fail_key"), KEY),
    st.tuples(st.just("fail_peer"), PEERS),
    st.tuples(st.just("fail_all")),
)


def _outcome(fut: asyncio.Future[int]) -> Any:
    if not fut.done():
        return "pending"
    if fut.cancelled():
        return "cancelled"
    exc = fut.exception()
    return ("error", type(exc).__name__, str(exc)) if exc is not None else ("ok", fut.result())


def _run(make: Any, ops: list[tuple[Any, ...]]) -> list[Any]:
    """Run ``ops`` on a fresh mailbox made by ``make``; the trace of everything observable."""

    async def main() -> list[Any]:
        trace: list[Any] = []
        box = make(0, asyncio.get_running_loop(), 64, lambda *a: trace.append(("mismatch", a)))
        box.on_drain = lambda: trace.append("drain")
        box.on_post = lambda: trace.append("post")
        box.on_late = lambda *a: trace.append(("late", a))
        futures: list[asyncio.Future[int]] = []
        bufs: list[memoryview] = []
        matched: list[Any] = []  # receives handed out by match(), by position
        for step, op in enumerate(ops):
            name, args = op[0], op[1:]
            if name == "post":
                src, k, size, f = args
                buf = memoryview(bytearray(size))
                bufs.append(buf)
                futures.append(box.post(src, KEYS[k], buf, FPS[f]))
            elif name == "deliver":
                src, k, size, f, owned = args
                payload = memoryview(bytearray([step % 251] * size))
                box.deliver(src, KEYS[k], FPS[f], payload, owned=owned)
            elif name == "match":
                src, k, size, f = args
                got = box.match(src, KEYS[k], size, FPS[f])
                if got is None or got is DISCARD:
                    trace.append(("matched", got is DISCARD))
                else:
                    matched.append(got)
                    trace.append(("matched", futures.index(got.future), got.src, got.key, got.order >= 0))
                    got.buf[:] = bytes([step % 251]) * got.buf.nbytes
            elif name in ("complete", "repost"):
                if matched:
                    recv = matched.pop(args[0] % len(matched))
                    box.complete(recv, 1) if name == "complete" else box.repost(recv)
            elif name == "cancel":
                if futures:
                    box.cancel(futures[args[0] % len(futures)])
            elif name == "finish":
                trace.append(("finish", box.finish(KEYS[args[0]])))
            elif name == "abandon":
                box.abandon(KEYS[args[0]])
            elif name == "set_floor":
                box.set_floor(*args)
            elif name == "fail_key":
                box.fail_key(KEYS[args[0]], DistNetworkError(f"key {args[0]} failed"))
            elif name == "fail_peer":
                box.fail_peer(args[0], DistNetworkError(f"rank {args[0]} is gone"))
            else:
                box.fail_all(DistNetworkError("closed"))
            trace.append((step, box.unexpected_bytes, box.over_cap, [_outcome(f) for f in futures]))
        for k in KEYS:
            trace.append((box.was_finished(k), box.was_abandoned(k), box.waiting_on(k)))
        trace.append([bytes(b) for b in bufs])
        return trace

    return asyncio.run(main())


@settings(max_examples=1000, deadline=None)
@given(st.lists(OPS, max_size=40))
def test_same_programs_same_outcomes(ops: list[tuple[Any, ...]]) -> None:
    compiled = _compiled()
    assert _run(compiled.Mailbox, ops) == _run(matching.Mailbox, ops)


def test_a_mismatch_reads_alike() -> None:
    """Both name the two operations and the sizes in the same words (the Python ``check``)."""
    compiled = _compiled()
    ops: list[tuple[Any, ...]] = [
        ("post", 1, 0, 8, 1),
        ("deliver", 1, 0, 4, 2, False),  # another dtype
        ("post", 1, 0, 8, 1),
        ("deliver", 1, 0, 4, 1, False),  # the same fingerprint, another size
        ("post", 1, 2, 8, 4),
        ("deliver", 1, 2, 8, 5, True),  # origins differ, no group book: a mismatch
    ]
    trace = _run(compiled.Mailbox, ops)
    assert trace == _run(matching.Mailbox, ops)
    last = next(t for t in reversed(trace) if type(t) is tuple and t[0] == len(ops) - 1)
    outcomes = last[3]
    assert outcomes[0][:2] == ("error", "CollectiveMismatchError") and "int64" in outcomes[0][2]
    assert "sent 4 bytes" in outcomes[1][2]
    assert outcomes[2][:2] == ("error", "CollectiveMismatchError")


def test_the_transport_runs_the_matcher_aiodist_native_chooses(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled = _compiled()
    loop = asyncio.new_event_loop()
    try:
        for mode, want in (("0", matching.Mailbox), ("1", compiled.Mailbox)):
            monkeypatch.setenv("AIODIST_NATIVE", mode)
            monkeypatch.setattr(native, "_choice", None)
            monkeypatch.setattr(native, "_loaded", {})
            assert type(matching.new_mailbox(0, loop)) is want
    finally:
        loop.close()
