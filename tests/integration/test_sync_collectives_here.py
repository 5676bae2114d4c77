"""Blocking collectives run on the caller's thread (``aiodist.collectives.here``).

Where the compiled engine runs, a blocking collective of a group whose members share this host
runs its steps on the caller's own thread, and hands them to the runtime's loop thread where
they stop completing there (a member late past the poll budget, a message that must wait its
turn, a failure). What users rely on is that this changes nothing but the time: every operation
gives the bytes the loop's way gives, whichever way each member ran it, and a mistake raises
what it raises the loop's way. The jobs run on both engines (the Python one always takes the
loop's way) and must agree bit for bit; each reports how many messages went the caller's way,
so the tests know the path they meant to test did run.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from aiodist import native
from aiodist.testing import spawn

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROUNDS = 12


def _both_engines(job: Any, size: int, *, timeout: float) -> dict[str, list[Any]]:
    """``job``'s results on ``size`` ranks with the compiled engine and with the Python one."""
    return {
        engine: spawn(job, size, timeout=timeout, env={"AIODIST_SHM": "1", "AIODIST_NATIVE": mode})
        for engine, mode in (("compiled", "auto"), ("python", "0"))
    }


def _here_sent() -> int:
    from aiodist.face import world as _world

    return int(getattr(_world.world().transport, "here_counts", (0, 0))[0])


def _collectives_job(rank: int, size: int) -> dict[str, Any]:
    import time

    import aiodist.sync as dist

    dist.init_process_group("tcp", timeout=60)
    got: list[Any] = []
    before = _here_sent()
    rng = np.random.default_rng(rank)
    for i in range(ROUNDS):
        root = i % size
        # Some rounds a member comes late (past the poll budget: the others hand over to their
        # loop's thread), or runs its call the loop's way (async_op) beside the others' here.
        late = i % 4 == 1 and rank == root
        loopway = i % 4 == 3 and rank == (root + 1) % size

        def run(fn: Any, *args: Any, late: bool = late, loopway: bool = loopway, **kw: Any) -> None:
            if late:
                time.sleep(0.05)
            if loopway:
                fn(*args, async_op=True, **kw).wait()
            else:
                fn(*args, **kw)

        f = rng.standard_normal(5).astype(np.float32)
        run(dist.all_reduce, f)
        got.append(("all_reduce sum", f.tolist()))
        m = np.array([rank * 7 + i, -rank], np.int64)
        run(dist.all_reduce, m, op=dist.ReduceOp.MAX)
        got.append(("all_reduce max", m.tolist()))
        a = np.full(3, float(rank + i), np.float64)
        run(dist.all_reduce, a, op=dist.ReduceOp.AVG)
        got.append(("all_reduce avg", a.tolist()))
        b = np.arange(4, dtype=np.int32) * (i + 1) if rank == root else np.zeros(4, np.int32)
        run(dist.broadcast, b, src=root)
        got.append(("broadcast", b.tolist()))
        r = np.full(2, rank + 1.5, np.float32)
        run(dist.reduce, r, dst=root)
        got.append(("reduce", r.tolist() if rank == root else None))
        outs = [np.zeros(2, np.int16) for _ in range(size)]
        run(dist.all_gather, outs, np.full(2, rank * 3 + i, np.int16))
        got.append(("all_gather", [o.tolist() for o in outs]))
        flat = np.zeros(2 * size, np.float32)
        run(dist.all_gather_into_tensor, flat, np.full(2, rank - i, np.float32))
        got.append(("all_gather_into_tensor", flat.tolist()))
        rs = np.zeros(3, np.float64)
        run(dist.reduce_scatter, rs, [np.full(3, rank * 10.0 + j, np.float64) for j in range(size)])
        got.append(("reduce_scatter", rs.tolist()))
        run(dist.barrier)
        gl = [np.zeros(2, np.float32) for _ in range(size)] if rank == root else None
        run(dist.gather, np.full(2, rank + 0.25, np.float32), gl, dst=root)
        got.append(("gather", [g.tolist() for g in gl] if gl is not None else None))
        sc = np.zeros(1, np.int32)
        run(
            dist.scatter,
            sc,
            [np.array([7 * j + i], np.int32) for j in range(size)] if rank == root else None,
            src=root,
        )
        got.append(("scatter", sc.tolist()))
        a2a = np.zeros(size, np.int64)
        run(dist.all_to_all_single, a2a, np.arange(size, dtype=np.int64) + 100 * rank)
        got.append(("all_to_all_single", a2a.tolist()))
    out = {"got": got, "here": _here_sent() - before, "engine": native.describe()}
    dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("size", [2, 3])
def test_every_small_collective_gives_the_loops_bytes(size: int) -> None:
    outs = _both_engines(_collectives_job, size, timeout=200)
    for rank in range(size):
        assert outs["compiled"][rank]["got"] == outs["python"][rank]["got"], rank
    # ... and the right bytes (the Python engine's path is the one the rest of the suite checks).
    got = [dict_of(o["got"]) for o in outs["python"]]
    for rank in range(size):
        assert got[rank]["broadcast"] == [[j * (i + 1) for j in range(4)] for i in range(ROUNDS)]
        assert got[rank]["all_to_all_single"] == [[100 * r + rank for r in range(size)]] * ROUNDS
        for i, row in enumerate(got[rank]["all_gather"]):
            assert row == [[r * 3 + i] * 2 for r in range(size)]
    assert all(o["here"] == 0 for o in outs["python"])
    res = outs["compiled"]
    if all(v == "compiled" for v in res[0]["engine"].values()):
        # Every member sent some of its messages from its own thread.
        assert all(o["here"] > 0 for o in res), [o["here"] for o in res]
    elif native.choice() == "on":
        pytest.fail(f"the compiled engine did not run: {res[0]['engine']}")


def dict_of(rows: list[tuple[str, Any]]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for name, value in rows:
        out.setdefault(name, []).append(value)
    return out


def _offloaded_job(rank: int, size: int) -> list[list[float]]:
    import aiodist.sync as dist
    from aiodist.collectives import select

    # Reductions from 4 KiB go to a worker thread, as they do from 512 KiB where the host has
    # a core to spare: on a caller's thread, which runs no loop, they run inline.
    select.offload_reduction = lambda nbytes: nbytes >= 4096  # type: ignore[assignment]
    dist.init_process_group("tcp", timeout=60)
    got = []
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        t = np.arange(2048, dtype=np.float32) * (rank + 1)
        dist.all_reduce(t, op=op)
        got.append(t[:4].tolist() + t[-2:].tolist())
    dist.destroy_process_group()
    return got


def test_reductions_a_worker_thread_would_run_give_the_loops_bytes() -> None:
    outs = _both_engines(_offloaded_job, 2, timeout=100)
    assert outs["compiled"] == outs["python"]
    assert outs["compiled"][0][0] == [0.0, 3.0, 6.0, 9.0, 2046 * 3.0, 2047 * 3.0]
    assert outs["compiled"][0][1] == [0.0, 1.5, 3.0, 4.5, 2046 * 1.5, 2047 * 1.5]


def _threads_job(rank: int, size: int) -> dict[str, Any]:
    import threading

    import aiodist.sync as dist

    dist.init_process_group("tcp", timeout=60)
    groups = [dist.new_group([0, 1]), dist.new_group([0, 1])]
    before = _here_sent()
    wrong: list[Any] = []
    errors: list[str] = []

    def worker(k: int) -> None:  # (each thread its own group: a program torch runs)
        try:
            for i in range(200):
                t = np.full(3, rank + i + 10 * k, np.float32)
                dist.all_reduce(t, group=groups[k])
                if not (t == sum(r + i + 10 * k for r in range(size))).all():
                    wrong.append(("all_reduce", k, i, t.tolist()))
                b = np.full(2, i if rank == 0 else -1, np.int64)
                dist.broadcast(b, 0, group=groups[k])
                if not (b == i).all():
                    wrong.append(("broadcast", k, i, b.tolist()))
        except BaseException as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(k,), name=f"worker-{k}") for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    out = {"wrong": wrong[:5], "errors": errors, "here": _here_sent() - before, "engine": native.describe()}
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_threads_each_on_its_own_group_run_side_by_side() -> None:
    """Blocking collectives of two threads at once, each on its own group, both on their
    callers' threads: every result right, none lost or crossed."""
    res = spawn(_threads_job, 2, timeout=150, env={"AIODIST_SHM": "1"})
    for out in res:
        assert out["wrong"] == [] and out["errors"] == [], out
    if all(v == "compiled" for v in res[0]["engine"].values()):
        assert all(o["here"] > 0 for o in res), [o["here"] for o in res]


def _mistakes_job(rank: int, size: int) -> dict[str, str]:
    import time

    import aiodist.sync as dist

    dist.init_process_group("tcp", timeout=60)
    out: dict[str, str] = {}
    for _ in range(3):  # (warm: shapes known, the caller's way open)
        dist.all_reduce(np.ones(2, np.float32))
    try:  # the members disagree about the operation (each receives the other's message)
        if rank == 0:
            dist.all_reduce(np.ones(2, np.float32))
        else:
            dist.all_gather_into_tensor(np.zeros(2, np.float32), np.ones(1, np.float32))
        out["disagree"] = "no error"
    except dist.DistError as exc:
        out["disagree"] = type(exc).__name__
    try:  # ... about its size
        dist.all_reduce(np.ones(2 + rank, np.float32))
        out["size"] = "no error"
    except dist.DistError as exc:
        out["size"] = type(exc).__name__
    try:  # bad arguments raise at the call, before anything is numbered
        dist.all_reduce(np.ones(2, np.float32), op="median")
        out["bad op"] = "no error"
    except (TypeError, ValueError) as exc:
        out["bad op"] = f"{type(exc).__name__}: {exc}"
    # A member that never comes: the others' blocking call times out, naming the operation.
    if rank == 0:
        try:
            dist.all_reduce(np.ones(2, np.float32), group=dist.new_group([0, 1], timeout=1))
            out["timeout"] = "no error"
        except dist.DistError as exc:
            out["timeout"] = f"{type(exc).__name__} {'all_reduce' in str(exc)}"
    else:
        dist.new_group([0, 1], timeout=1)
        time.sleep(3)
    dist.destroy_process_group()
    return out


def test_mistakes_raise_as_the_loops_way_does() -> None:
    outs = _both_engines(_mistakes_job, 2, timeout=200)
    assert outs["compiled"] == outs["python"]
    r0, r1 = outs["compiled"]
    assert r0["disagree"] == r1["disagree"] == "CollectiveMismatchError"
    assert r0["size"] == r1["size"] == "CollectiveMismatchError"
    assert r0["bad op"].startswith("DistValueError: op: unknown reduce op"), r0
    assert r0["timeout"] == "DistTimeoutError True", r0
