"""Every init method with real processes over loopback TCP (1-4 ranks)."""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aiodist as dist
from aiodist.testing import RankFailed, free_port, spawn

pytestmark = pytest.mark.timeout(90)


async def _ring_check() -> tuple[int, int]:
    """Each rank sends its rank to the next and receives from the previous: proves the mesh works."""
    rank, size = dist.get_rank(), dist.get_world_size()
    if size > 1:
        out = np.array([rank], np.int64)
        got = np.zeros(1, np.int64)
        w = dist.recv(got, (rank - 1) % size)
        await dist.send(out, (rank + 1) % size)
        assert await w == (rank - 1) % size and got[0] == (rank - 1) % size
    await dist.barrier()
    return rank, size


async def _env_job(rank: int, size: int) -> Any:
    await dist.init_process_group("tcp", "env://", timeout=30)
    res = await _ring_check()
    assert dist.is_initialized() and dist.get_backend() == "tcp"
    await dist.destroy_process_group()
    assert not dist.is_initialized()
    return res


@pytest.mark.parametrize("size", [1, 2, 4])
def test_env_init(size: int) -> None:
    assert spawn(_env_job, size) == [(r, size) for r in range(size)]


async def _launcher_vars_job(rank: int, size: int, prefix: str, size_var: str) -> Any:
    os.environ.pop("RANK")
    os.environ.pop("WORLD_SIZE")
    os.environ[f"{prefix}"] = str(rank)
    os.environ[size_var] = str(size)
    await dist.init_process_group("gloo")  # "gloo" is an alias of "tcp"; init_method defaults to env://
    res = await _ring_check()
    await dist.destroy_process_group()
    return res


@pytest.mark.parametrize(
    ("rank_var", "size_var"),
    [
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("PMI_RANK", "PMI_SIZE"),
        ("SLURM_PROCID", "SLURM_NTASKS"),
    ],
)
def test_env_init_from_mpirun_pmi_slurm_variables(rank_var: str, size_var: str) -> None:
    assert spawn(_launcher_vars_job, 2, args=(rank_var, size_var)) == [(0, 2), (1, 2)]


async def _tcp_job(rank: int, size: int, port: int, auto: bool) -> Any:
    await dist.init_process_group(
        "tcp", f"tcp://127.0.0.1:{port}", rank=-1 if auto else rank, world_size=size, timeout=30
    )
    res = await _ring_check()
    await dist.destroy_process_group()
    return res


@pytest.mark.parametrize("auto", [False, True])
def test_tcp_init(auto: bool) -> None:
    res = spawn(_tcp_job, 3, args=(free_port(), auto))
    assert sorted(r for r, _ in res) == [0, 1, 2] and {s for _, s in res} == {3}
    if not auto:
        assert res == [(0, 3), (1, 3), (2, 3)]


async def _file_job(rank: int, size: int, path: str, auto: bool) -> Any:
    await dist.init_process_group(
        "tcp", f"file://{path}", rank=-1 if auto else rank, world_size=size, timeout=30
    )
    res = await _ring_check()
    await dist.destroy_process_group()
    return res


@pytest.mark.parametrize("auto", [False, True])
def test_file_init(tmp_path: Path, auto: bool) -> None:
    res = spawn(_file_job, 3, args=(str(tmp_path / "rdv"), auto))
    assert sorted(r for r, _ in res) == [0, 1, 2]


async def _multicast_job(rank: int, size: int, port: int) -> Any:
    os.environ["AIODIST_MULTICAST_IF"] = "127.0.0.1"
    await dist.init_process_group(
        "tcp", f"tcp://239.255.77.{port % 200 + 1}:{port}", world_size=size, timeout=30
    )
    res = await _ring_check()
    await dist.destroy_process_group()
    return res


def test_legacy_multicast_init() -> None:
    res = spawn(_multicast_job, 3, args=(free_port(),))
    assert sorted(r for r, _ in res) == [0, 1, 2]


async def _two_jobs(rank: int, size: int, port: int, done_path: str) -> Any:
    # processes 0,2 form job "a", processes 1,3 form job "b": one address, two group names
    job = "ab"[rank % 2]
    await dist.init_process_group(
        "tcp", f"tcp://127.0.0.1:{port}", rank=rank // 2, world_size=2, group_name=job, timeout=30
    )
    mine = np.array([rank], np.int64)
    other = np.zeros(1, np.int64)
    peer = 1 - dist.get_rank()
    w = dist.recv(other, peer)
    await dist.send(mine, peer)
    await w
    await dist.barrier()
    # Whoever hosts the shared store must outlive both jobs' use of it: meet in a side store.
    side = dist.FileStore(done_path, 4)
    await side.add("done", 1)
    while int(await side.get("done")) < 4:
        await asyncio.sleep(0.02)
    await dist.destroy_process_group()
    return job, int(other[0])


def test_group_names_keep_jobs_on_one_address_apart(tmp_path: Path) -> None:
    res = spawn(_two_jobs, 4, args=(free_port(), str(tmp_path / "done")))
    # each process only ever talked to the other process of its own job
    assert res == [("a", 2), ("b", 3), ("a", 0), ("b", 1)]


async def _partial_job(rank: int, size: int) -> Any:
    if rank == size - 1:
        return None  # never joins
    start = time.monotonic()
    with pytest.raises(dist.DistTimeoutError) as info:
        await dist.init_process_group("tcp", "env://", timeout=3)
    return time.monotonic() - start, str(info.value)


@pytest.mark.parametrize("size", [3, 4])
def test_missing_rank_times_out_naming_it(size: int) -> None:
    res = spawn(_partial_job, size)
    for took, msg in res[:-1]:
        assert 2.5 <= took <= 6, took
        assert f"joined {size - 1} of {size}" in msg and f"missing rank {size - 1}" in msg, msg


async def _duplicate_job(rank: int, size: int, port: int) -> Any:
    start = time.monotonic()
    try:
        await dist.init_process_group(
            "tcp", f"tcp://127.0.0.1:{port}", rank=min(rank, 1), world_size=3, timeout=10
        )
    except dist.DistError as exc:
        return time.monotonic() - start, str(exc)
    return None


def test_duplicate_rank_fails_fast_naming_it() -> None:
    res = spawn(_duplicate_job, 3, args=(free_port(),))
    for took, msg in res:
        assert took < 8
        # both claimants are named (pid and host), on every rank
        assert re.search(r"two processes claim rank 1: pid \d+ on .+ and pid \d+ on ", msg), msg


async def _own_store_job(rank: int, size: int, port: int) -> Any:
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=30)
    await dist.init_process_group(store=store, rank=rank, world_size=size, timeout=30)
    res = await _ring_check()
    await dist.destroy_process_group()
    await store.set(f"done/{rank}", b"1")  # the store is still ours to use
    if rank == 0:  # the host closes the store only once nobody needs it any more
        await store.wait([f"done/{r}" for r in range(size)])
    await store.aclose()
    return res


def test_bring_your_own_store() -> None:
    assert spawn(_own_store_job, 2, args=(free_port(),)) == [(0, 2), (1, 2)]


async def _reinit_job(rank: int, size: int) -> Any:
    out = []
    for _ in range(3):
        os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]))
        await dist.init_process_group("tcp", "env://", timeout=30)
        out.append(await _ring_check())
        await dist.destroy_process_group()
    return out


def test_destroy_then_init_again() -> None:
    res = spawn(_reinit_job, 2)
    assert res == [[(0, 2)] * 3, [(1, 2)] * 3]


def test_init_twice_and_uninitialised_use_are_errors() -> None:
    with pytest.raises(ValueError, match="not been initialized"):
        dist.get_rank()
    with pytest.raises(ValueError, match="unknown backend"):
        asyncio.run(dist.init_process_group("mpi"))
    with pytest.raises(ValueError, match="unknown scheme"):
        asyncio.run(dist.init_process_group("tcp", "udp://x:1", rank=0, world_size=1))


def test_rank_failed_is_reported() -> None:
    with pytest.raises(RankFailed, match="rank 1 raised"):
        spawn(_raises, 2)


def _raises(rank: int, size: int) -> None:
    if rank == 1:
        raise RuntimeError("boom")


def _out_of_range_job(rank: int, size: int, tmp: str) -> list[tuple[str, str, str, float]]:
    """Every init method and both faces, given a rank the world size has no room for. Nothing
    listens on the ports used: a rank that went on to the rendezvous would wait for its timeout."""
    import datetime

    import aiodist.sync as sdist

    port = free_port()
    cases: list[tuple[str, dict[str, Any]]] = [
        ("env://", dict(init_method="env://", rank=2, world_size=2)),
        ("env:// RANK=5", dict(init_method="env://", env={"RANK": "5", "WORLD_SIZE": "3"})),
        ("env:// rank -2", dict(init_method="env://", rank=-2, world_size=2)),
        ("tcp://", dict(init_method=f"tcp://127.0.0.1:{port}", rank=2, world_size=2)),
        ("tcp:// rank -3", dict(init_method=f"tcp://127.0.0.1:{port}", rank=-3, world_size=2)),
        ("multicast", dict(init_method=f"tcp://239.1.2.3:{port}", rank=4, world_size=2)),
        ("file://", dict(init_method=f"file://{tmp}/store", rank=3, world_size=3)),
        ("store=", dict(store=True, rank=2, world_size=2)),
    ]
    out = []
    for face in ("async", "sync"):
        for what, kw in cases:
            kw = dict(kw)
            os.environ.update(kw.pop("env", {}))
            os.environ["MASTER_PORT"] = str(port)
            if kw.pop("store", False):
                kw["store"] = sdist.HashStore() if face == "sync" else dist.HashStore()
            t0 = time.monotonic()
            try:
                if face == "async":
                    asyncio.run(dist.init_process_group("tcp", timeout=60, **kw))
                else:
                    sdist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60), **kw)
                err = ("no error", "")
            except Exception as exc:
                err = (type(exc).__name__, str(exc))
            os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(size)
            out.append((f"{face} {what}", *err, time.monotonic() - t0))
    return out


def test_a_rank_out_of_range_is_refused_at_once(tmp_path: Path) -> None:
    """rank >= world_size (or below 0, where -1 does not ask for one) fails in init_process_group
    before any store is hosted or waited for, naming both values, on both faces."""
    (res,) = spawn(_out_of_range_job, 1, args=(str(tmp_path),), timeout=80)
    for what, name, msg, took in res:
        assert name == "DistValueError", (what, name, msg)
        found = re.search(r"rank (-?\d+) is out of range for world_size (\d+)", msg)
        assert found, (what, msg)
        assert took < 10, (what, took)  # not the init timeout of 60 s: nothing was waited for
    by_case = {what: msg for what, _, msg, _ in res}
    assert "rank 5 is out of range for world_size 3" in by_case["sync env:// RANK=5"]
    assert "or -1 to be assigned one" in by_case["async tcp:// rank -3"]
    assert "or -1" not in by_case["async env:// rank -2"]


async def test_an_init_that_fails_after_joining_leaves_no_job_open(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiodist.face import world as _world
    from aiodist.job import open_jobs

    def broken(*args: Any) -> Any:
        raise RuntimeError("no backend for you")

    port = free_port()
    monkeypatch.setattr(_world, "_backend_for", broken)
    with pytest.raises(RuntimeError, match="no backend for you"):
        await dist.init_process_group("tcp", f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=10)
    assert open_jobs() == () and not dist.is_initialized()
    monkeypatch.undo()
    # The store it hosted is closed too: the address serves the next init at once.
    await dist.init_process_group("tcp", f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=10)
    assert len(open_jobs()) == 1
    await dist.destroy_process_group()
    assert open_jobs() == ()
