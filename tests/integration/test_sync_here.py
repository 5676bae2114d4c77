"""Blocking sends and receives done on the caller's thread (``aiodist.transport.shm_here``).

Where the compiled engine runs, a small blocking ``send``/``recv`` with a peer of this host goes
without the hop to the runtime's loop thread. What users rely on is that it changes nothing but
the time: every message arrives, in order, into the right buffer, whatever runs beside it
(non-blocking operations before it, collectives, a late receiver, a receive from any rank), and
a mistake raises what it raises the loop's way. Each job also reports how many messages went
the caller's way, so that the tests know the path they meant to test did run (and, on the
Python engine, did not).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

from aiodist import native
from aiodist.testing import spawn

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ROUNDS = 300
SLOW_ROUNDS = 20
IRECV_ROUNDS = 20


def _here_counts() -> tuple[int, int]:
    from aiodist.face import world as _world

    return tuple(getattr(_world.world().transport, "here_counts", (0, 0)))  # type: ignore[return-value]


def _traffic_job(rank: int, size: int) -> dict[str, Any]:
    import time

    import aiodist.sync as dist

    dist.init_process_group("tcp", timeout=60)
    peer = 1 - rank
    out: dict[str, Any] = {"wrong": []}
    buf = np.zeros(4, np.float64)
    for i in range(ROUNDS):  # ping-pong, tags and sizes changing
        tag = i % 3
        if rank == 0:
            dist.send(np.full(4, i, np.float64), peer, tag=tag)
            got = dist.recv(buf, peer, tag=tag)
            if got != peer or not (buf == i + 0.5).all():
                out["wrong"].append(("pingpong", i, buf.tolist()))
        else:
            dist.recv(buf, peer, tag=tag)
            if not (buf == i).all():
                out["wrong"].append(("pingpong", i, buf.tolist()))
            dist.send(buf + 0.5, peer, tag=tag)
    # Non-blocking sends, then blocking ones of the same tag: they arrive after the burst.
    # (a message of that shape first: the first of a shape is written the loop's way)
    if rank == 0:
        dist.send(np.full(2, -1, np.int32), peer, tag=4)
    else:
        dist.recv(np.zeros(2, np.int32), peer, tag=4)
    if rank == 0:
        sent_before = _here_counts()[0]
        works = [dist.isend(np.full(2, i, np.int32), peer, tag=5) for i in range(50)]
        for i in range(50, 60):
            dist.send(np.full(2, i, np.int32), peer, tag=5)
        for w in works:
            w.wait()
        out["burst here"] = _here_counts()[0] - sent_before
    else:
        small = np.zeros(2, np.int32)
        seen = []
        for _ in range(60):
            dist.recv(small, peer, tag=5)
            seen.append(int(small[0]))
        if seen != list(range(60)):
            out["wrong"].append(("burst order", seen))
    # Receives posted ahead (irecv), then a blocking one of the same tag: it gets the last message.
    if rank == 1:
        bufs = [np.zeros(1, np.float32) for _ in range(5)]
        works = [dist.irecv(b, peer, tag=6) for b in bufs]
        last = np.zeros(1, np.float32)
        dist.barrier()
        dist.recv(last, peer, tag=6)
        for w in works:
            w.wait()
        if [float(b[0]) for b in bufs] + [float(last[0])] != [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]:
            out["wrong"].append(("posted ahead", [float(b[0]) for b in bufs], float(last[0])))
    else:
        dist.barrier()
        for i in range(6):
            dist.send(np.full(1, i, np.float32), peer, tag=6)
    # A late receiver: the message waits, held, then the receive takes it.
    if rank == 0:
        dist.send(np.arange(3, dtype=np.int64), peer, tag=7)
    else:
        time.sleep(0.2)
        got3 = np.zeros(3, np.int64)
        dist.recv(got3, peer, tag=7)
        if got3.tolist() != [0, 1, 2]:
            out["wrong"].append(("late", got3.tolist()))
    # Collectives between blocking point-to-point calls, and a receive from any rank.
    t = np.ones(2, np.float32)
    dist.all_reduce(t)
    if t.tolist() != [2.0, 2.0]:
        out["wrong"].append(("all_reduce", t.tolist()))
    if rank == 0:
        dist.send(np.full(1, 42, np.int16), peer)
    else:
        any_src = np.zeros(1, np.int16)
        if dist.recv(any_src) != peer or any_src[0] != 42:
            out["wrong"].append(("any source", any_src.tolist()))
    # A sender that computes past the receiver's poll budget: the receive sleeps on its own
    # thread until the writer wakes it (where the engine can), rather than going the loop's way.
    received_before = _here_counts()[1]
    for i in range(SLOW_ROUNDS):
        if rank == 0:
            time.sleep(0.003)
            dist.send(np.full(1, i, np.float64), peer, tag=8)
        else:
            one = np.zeros(1, np.float64)
            dist.recv(one, peer, tag=8)
            if one[0] != i:
                out["wrong"].append(("slow sender", i, float(one[0])))
    out["slow here"] = _here_counts()[1] - received_before
    # Non-blocking receives: of messages that have come (taken on this thread, done at once),
    # then of messages still to come (posted behind them; their waits take them here).
    if rank == 0:
        for i in range(IRECV_ROUNDS):
            dist.send(np.full(1, i, np.float32), peer, tag=9)
        dist.barrier()
        dist.barrier()
        for i in range(IRECV_ROUNDS, 2 * IRECV_ROUNDS):
            dist.send(np.full(1, i, np.float32), peer, tag=9)
    else:
        dist.barrier()  # (every message of the first half has been written)
        received_before = _here_counts()[1]
        bufs = [np.zeros(1, np.float32) for _ in range(2 * IRECV_ROUNDS)]
        works = [dist.irecv(b, peer, tag=9) for b in bufs[:IRECV_ROUNDS]]
        out["irecv done at once"] = sum(w.is_completed() for w in works)
        out["irecv here"] = _here_counts()[1] - received_before
        works += [dist.irecv(b, peer, tag=9) for b in bufs[IRECV_ROUNDS:]]
        dist.barrier()
        received_before = _here_counts()[1]
        for w in works:
            w.wait()
        out["irecv waited here"] = _here_counts()[1] - received_before
        senders = [w.source_rank() for w in works]
        if [float(b[0]) for b in bufs] != list(range(2 * IRECV_ROUNDS)) or set(senders) != {peer}:
            out["wrong"].append(("irecv", [float(b[0]) for b in bufs], senders))
    out["here"] = _here_counts()
    out["engine"] = native.describe()
    dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("engine", ["compiled", "python"])
def test_every_message_arrives_in_order_either_way(engine: str) -> None:
    env = {"AIODIST_NATIVE": "0" if engine == "python" else "auto", "AIODIST_SHM": "1"}
    res = spawn(_traffic_job, 2, timeout=110, env=env)
    for out in res:
        assert out["wrong"] == []
    compiled = all(v == "compiled" for v in res[0]["engine"].values())
    if engine == "python" or not compiled:
        assert all(out["here"] == (0, 0) for out in res), [out["here"] for out in res]
        if engine == "compiled" and native.choice() == "on":
            pytest.fail(f"the compiled engine did not run: {res[0]['engine']}")
    else:
        # Most of the ping-pong went the caller's way on both ranks (some first messages of a
        # shape, and those that found the loop's thread busy, take the loop's).
        for out in res:
            sent, received = out["here"]
            assert sent >= ROUNDS // 2 and received >= ROUNDS // 2, out["here"]
        # The non-blocking sends of the burst went the caller's way too (most: one that finds
        # the loop's thread writing goes its way, and those after it until it has started).
        assert res[0]["burst here"] >= 30, res[0]["burst here"]
        # The receives that waited for the slow sender, 3 ms each, past the poll budget: most
        # were woken on their own thread (one of the loop's thread's own looks may take a few),
        # where a thread can sleep on the segment (Linux futexes).
        if sys.platform.startswith("linux"):
            assert res[1]["slow here"] >= SLOW_ROUNDS // 2, res[1]["slow here"]
        # The non-blocking receives of messages that had come were all done on this thread,
        # and most of those posted before their messages were taken by their waits there.
        assert res[1]["irecv done at once"] == res[1]["irecv here"] == IRECV_ROUNDS, res[1]
        if sys.platform.startswith("linux"):
            assert res[1]["irecv waited here"] >= IRECV_ROUNDS // 2, res[1]


def _mistake_job(rank: int, size: int) -> dict[str, str]:
    import aiodist.sync as dist

    dist.init_process_group("tcp", timeout=60)
    peer = 1 - rank
    out: dict[str, str] = {}
    for _ in range(3):  # (warm: the shapes known, the caller's way open)
        if rank == 0:
            dist.send(np.zeros(2, np.float32), peer)
        else:
            dist.recv(np.zeros(2, np.float32), peer)
    try:
        if rank == 0:
            dist.send(np.zeros(2, np.float32), peer, tag=1)
        else:
            dist.recv(np.zeros(3, np.float32), peer, tag=1)  # (a buffer of another size)
        out["size"] = "no error"
    except dist.DistError as exc:
        out["size"] = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    for label, call in {
        "to self": lambda: dist.send(np.zeros(1), rank),
        "out of range": lambda: dist.recv(np.zeros(1), 5),
        "bad tag": lambda: dist.send(np.zeros(1), peer, tag="x"),  # type: ignore[arg-type]
    }.items():
        try:
            call()
            out[label] = "no error"
        except (ValueError, TypeError) as exc:
            out[label] = type(exc).__name__  # (aiodist's, which are ValueError and TypeError too)
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_mistakes_raise_as_the_loops_way_does() -> None:
    """The same errors, word for word, on the compiled engine (the caller's way where it
    applies) and on the Python engine (always the loop's way)."""
    outs = {
        engine: spawn(_mistake_job, 2, timeout=110, env={"AIODIST_SHM": "1", "AIODIST_NATIVE": mode})
        for engine, mode in (("compiled", "auto"), ("python", "0"))
    }
    assert outs["compiled"] == outs["python"]
    res = outs["compiled"]
    assert res[1]["size"].startswith("CollectiveMismatchError: rank 1 expected send of 3 x float32"), res[1]
    for out in res:
        assert out["to self"] == "DistValueError" and out["out of range"] == "DistValueError"
        assert out["bad tag"] == "DistTypeError"


# -- non-blocking receives posted on the caller's thread before their messages ------------------

POSTED_T = 3.0  # the group's timeout in this job (FAULTS' T)


def _posted_job(rank: int, size: int) -> dict[str, Any]:
    import time

    import aiodist.sync as dist

    dist.init_process_group("tcp", timeout=POSTED_T)
    peer = 1 - rank
    out: dict[str, Any] = {"engine": native.describe()}
    one = np.zeros(1, np.float32)
    for _ in range(3):  # (warm: the shape known, the caller's way open)
        (dist.send if rank == 0 else dist.recv)(one, peer)

    def value(i: float) -> np.ndarray:
        return np.full(1, i, np.float32)

    # Nothing is ever sent on tag 5: the receive times out T after the call, waited for or not.
    if rank == 1:
        w = dist.irecv(np.zeros(1, np.float32), peer, tag=5)
        out["posted"] = type(w).__name__
        time.sleep(POSTED_T + 1.5)
        out["unwaited"] = (w.is_completed(), type(w.exception()).__name__)
        w = dist.irecv(np.zeros(1, np.float32), peer, tag=5)
        began = time.monotonic()
        try:
            w.wait()
            out["timeout"] = "no error"
        except dist.DistTimeoutError as exc:
            out["timeout"] = str(exc)
        out["timeout after"] = time.monotonic() - began
    else:
        time.sleep(2 * POSTED_T + 2)  # (meanwhile: the barrier's timeout would run out here)
    dist.barrier()
    # The group goes on: receives posted before their messages, waited for in reverse order,
    # one through a thread-safe future, one dropped (it still takes its message: the next
    # receive gets the next one).
    if rank == 0:
        dist.barrier()
        for i in range(3):
            dist.send(value(i), peer, tag=7)
        dist.send(value(10), peer, tag=8)
        dist.send(value(20), peer, tag=9)
        dist.send(value(21), peer, tag=9)
    else:
        bufs = [np.zeros(1, np.float32) for _ in range(3)]
        works = [dist.irecv(b, peer, tag=7) for b in bufs]
        fbuf = np.zeros(1, np.float32)
        fut = dist.irecv(fbuf, peer, tag=8).get_future()
        dropped = dist.irecv(np.zeros(1, np.float32), peer, tag=9)
        del dropped
        kept = np.zeros(1, np.float32)
        last = dist.irecv(kept, peer, tag=9)
        dist.barrier()
        senders = [w.wait() and w.source_rank() for w in reversed(works)]
        out["reversed"] = ([float(b[0]) for b in bufs], senders)
        out["future"] = (fut.result(timeout=30), float(fbuf[0]))
        last.wait()
        out["after dropped"] = float(kept[0])
    dist.barrier()
    # A receive pending when its group is destroyed fails, saying so.
    g = dist.new_group([0, 1])
    if rank == 1:
        w = dist.irecv(np.zeros(1, np.float32), peer, group=g, tag=11)
    dist.destroy_process_group(g)
    if rank == 1:
        out["destroyed"] = f"{type(w.exception()).__name__}: {w.exception()}"
    # A receive pending when its sender leaves fails, naming itself and the sender.
    if rank == 0:
        dist.barrier()
        dist.destroy_process_group()
        return out
    w = dist.irecv(np.zeros(1, np.float32), peer, tag=12)
    dist.barrier()
    try:
        w.wait()
        out["left"] = "no error"
    except dist.DistError as exc:
        out["left"] = f"{type(exc).__name__}: {exc}"
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(180)
def test_posted_receives_keep_every_contract() -> None:
    """A non-blocking receive posted before its message behaves as the loop's way's: its
    timeout counts from the call (waited for or not), the group goes on after it, waits in
    any order and a future give the right data, a dropped receive still takes its message,
    and destroying the group or losing the sender fails it, naming it. The compiled engine
    (posted on the caller's thread) and the Python engine (the loop's way) agree."""
    outs = {
        engine: spawn(_posted_job, 2, timeout=170, env={"AIODIST_SHM": "1", "AIODIST_NATIVE": mode})
        for engine, mode in (("compiled", "auto"), ("python", "0"))
    }
    for engine, res in outs.items():
        out = res[1]
        assert out["unwaited"] == (True, "DistTimeoutError"), (engine, out)
        assert "recv from rank 0 (tag 5) on rank 1" in out["timeout"], (engine, out)
        assert f"timeout of {POSTED_T:g} s" in out["timeout"], (engine, out)
        assert POSTED_T - 0.1 <= out["timeout after"] <= POSTED_T + 2, (engine, out)
        assert out["reversed"] == ([0.0, 1.0, 2.0], [0, 0, 0]), (engine, out)
        assert out["future"] == (0, 10.0), (engine, out)
        assert out["after dropped"] == 21.0, (engine, out)
        assert out["destroyed"].startswith("DistError: recv from rank 0 (tag 11) on rank 1"), (engine, out)
        assert "destroyed" in out["destroyed"], (engine, out)
        assert out["left"].startswith("DistNetworkError: recv from rank 0 (tag 12) on rank 1"), (engine, out)
    engine = outs["compiled"][1]["engine"]
    if all(v == "compiled" for v in engine.values()):
        assert outs["compiled"][1]["posted"] == "_PostedHere", outs["compiled"][1]
    elif native.choice() == "on":
        pytest.fail(f"the compiled engine did not run: {engine}")
    assert outs["python"][1]["posted"] != "_PostedHere", outs["python"][1]
