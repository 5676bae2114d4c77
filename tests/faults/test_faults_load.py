"""Load without faults: many operations in flight, mixed sizes, a responsive loop, with real
processes (FAULTS.md rows 22, 23, 24).

Every result is checked exactly: inputs are small integers (also in float dtypes), so every
reduction order gives the same bits as a fixed-order reference.
"""

from __future__ import annotations

import asyncio
import random
import resource
import time
from typing import Any

import numpy as np
import pytest
from support.faults import record

import aiodist as dist
from aiodist.face.world import world
from aiodist.testing import spawn

pytestmark = pytest.mark.timeout(150)

IN_FLIGHT = 10_000
MIXED_OPS = 1000
DTYPES = [np.int64, np.int32, np.uint8, np.float32, np.float64, np.int16]


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _size_bytes(rng: random.Random) -> int:
    """1 B - 16 MiB, mostly small (as a real mix is), a few large ones."""
    roll = rng.random()
    if roll < 0.90:
        return rng.randint(1, 64 << 10)
    if roll < 0.98:
        return rng.randint(64 << 10, 1 << 20)
    return rng.randint(1 << 20, 16 << 20)


def _pattern(count: int, dtype: Any, salt: int) -> np.ndarray:
    return ((np.arange(count, dtype=np.int64) * 7 + salt) % 50).astype(dtype)


async def _one(i: int, rng: random.Random, rank: int, size: int) -> tuple[str, Any]:
    """Start the i-th operation of the mix (same choice on every rank); return a checker."""
    dtype = rng.choice(DTYPES)
    item = np.dtype(dtype).itemsize
    count = max(size, _size_bytes(rng) // item // size * size)  # a multiple of size (reduce_scatter)
    kind = rng.choice(["all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "p2p"])
    root = rng.randrange(size)
    if kind == "all_reduce":
        x = _pattern(count, dtype, rank + i)
        expect = sum(_pattern(count, np.int64, r + i) for r in range(size)).astype(dtype)
        return kind, (dist.all_reduce(x), x, expect)
    if kind == "broadcast":
        x = _pattern(count, dtype, i) if rank == root else np.zeros(count, dtype)
        return kind, (dist.broadcast(x, root), x, _pattern(count, dtype, i))
    if kind == "all_gather":
        per = count // size
        out = np.zeros(per * size, dtype)
        expect = np.concatenate([_pattern(per, dtype, r + i) for r in range(size)])
        return kind, (dist.all_gather_into_tensor(out, _pattern(per, dtype, rank + i)), out, expect)
    if kind == "reduce_scatter":
        per = count // size
        out = np.zeros(per, dtype)
        full = sum(_pattern(count, np.int64, r + i) for r in range(size))
        expect = full[rank * per : (rank + 1) * per].astype(dtype)
        return kind, (dist.reduce_scatter_tensor(out, _pattern(count, dtype, rank + i)), out, expect)
    if kind == "all_to_all":
        per = count // size
        inp = np.concatenate([_pattern(per, dtype, 100 * rank + d + i) for d in range(size)])
        out = np.zeros_like(inp)
        expect = np.concatenate([_pattern(per, dtype, 100 * s + rank + i) for s in range(size)])
        return kind, (dist.all_to_all_single(out, inp), out, expect)
    # p2p ring, on the operation's own tag
    buf = np.zeros(count, dtype)
    prev, nxt = (rank - 1) % size, (rank + 1) % size
    recv = dist.irecv(buf, prev, tag=i)
    send = dist.isend(_pattern(count, dtype, rank + i), nxt, tag=i)
    return kind, (asyncio.gather(send, recv), buf, _pattern(count, dtype, prev + i))


async def _load_job(rank: int, size: int) -> dict[str, Any]:
    await dist.init_process_group("tcp", "env://", timeout=60)
    store = world().store
    out: dict[str, Any] = {}
    # -- row 23: 10,000 small operations in flight at once, then wait for all
    rss0 = _rss_mib()
    xs = [np.full(4, rank + k, np.int64) for k in range(IN_FLIGHT)]
    t0 = time.monotonic()
    works = [dist.all_reduce(x) for x in xs]
    await asyncio.wait_for(asyncio.gather(*works), 60)
    out["inflight_s"] = time.monotonic() - t0
    out["inflight_ok"] = all(int(x[0]) == sum(r + k for r in range(size)) for k, x in enumerate(xs))
    out["inflight_rss_growth_mib"] = _rss_mib() - rss0
    del xs, works
    # -- row 22: 1000 mixed operations, up to 16 in flight, with store traffic, every result exact
    rng = random.Random(2024)  # the same sequence of choices on every rank
    t0 = time.monotonic()
    done, bad = 0, []
    while done < MIXED_OPS:
        batch = [await _one(done + j, rng, rank, size) for j in range(min(16, MIXED_OPS - done))]
        await store.add(f"load/{rank}", len(batch))
        await asyncio.wait_for(asyncio.gather(*(w for _, (w, _, _) in batch)), 60)
        for j, (kind, (_, got, expect)) in enumerate(batch):
            if not np.array_equal(got, expect):
                bad.append((done + j, kind, str(got.dtype), got.size))
        done += len(batch)
    counts = [int(await store.get(f"load/{r}")) for r in range(size)] if rank == 0 else []
    await dist.barrier()
    out.update(mixed_s=time.monotonic() - t0, bad=bad, counts=counts, rss_mib=_rss_mib())
    await dist.destroy_process_group()
    return out


def test_many_in_flight_and_a_thousand_mixed_operations() -> None:
    res = spawn(_load_job, 4, timeout=140)
    for r in res:
        assert r["inflight_ok"] and not r["bad"], r
        assert r["inflight_rss_growth_mib"] < 600, r  # bounded: ~tens of KiB per operation at most
        assert r["rss_mib"] < 2000, r
    assert res[0]["counts"] == [MIXED_OPS] * 4
    record(23, f"{IN_FLIGHT} all_reduce in flight, 4 ranks, all complete", max(r["inflight_s"] for r in res))
    record(22, f"{MIXED_OPS} mixed operations (1 B - 16 MiB), 4 ranks, exact", max(r["mixed_s"] for r in res))


async def _ticking(rank: int, size: int) -> dict[str, Any]:
    await dist.init_process_group("tcp", "env://", timeout=60)
    loop = asyncio.get_running_loop()
    x = np.full(64 << 20, rank + 1, np.float32)  # 256 MiB
    attempts = []
    for _ in range(3):
        ticks: list[float] = []
        stop = asyncio.Event()

        async def tick(ticks: list[float] = ticks, stop: asyncio.Event = stop) -> None:
            while not stop.is_set():
                ticks.append(loop.time())
                await asyncio.sleep(0.01)

        x[:] = rank + 1
        await dist.barrier()
        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.03)
        start = loop.time()
        await dist.all_reduce(x)
        end = loop.time()
        await asyncio.sleep(0.03)
        stop.set()
        await ticker
        assert (x == size * (size + 1) / 2).all()
        gaps = np.diff(ticks)
        attempts.append({"max_gap": float(gaps.max()), "elapsed": end - start, "ticks": len(ticks)})
        ok = np.array([attempts[-1]["max_gap"] <= 0.05], np.int64)
        await dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank stops after the same attempt
        if ok[0]:
            break
    await dist.destroy_process_group()
    return {"attempts": attempts}


def test_loop_ticks_every_10ms_during_a_256mib_all_reduce() -> None:
    """Row 24. The machine is shared (2 cores, other test runs): a scheduler hiccup of the OS
    is not the runtime's; so the best of up to three runs must meet the bound."""
    res = spawn(_ticking, 2, timeout=120)
    for r in res:
        best = min(a["max_gap"] for a in r["attempts"])
        assert best <= 0.05, r["attempts"]
        record(24, "largest tick gap during a 256 MiB all_reduce (best of <= 3)", best)
