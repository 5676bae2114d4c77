"""Staging through host buffers, on CPU: the pool's contract (reuse, size buckets, bound, release on
destroy) and every operation staged through ``HostStager`` -- the CPU twin of ``CudaStager``
with the same contract -- over the memory transport and over TCP in both faces. Only the
device hop itself (streams, events, pinned memory) is left to tests/test_cuda.py."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from suite_common import async_suite, check_async_suite, check_sync_suite, sync_suite

import aiodist as dist
from aiodist import _tensors
from aiodist.backends import staged as _staging
from aiodist.backends.staged import BufferPool, HostStager
from aiodist.face import world as _world
from aiodist.group import ProcessGroup
from aiodist.store import HashStore
from aiodist.testing import memory_world, spawn

pytestmark = pytest.mark.timeout(90)

try:
    import torch
except ImportError:  # pragma: no cover - torch is optional
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")


# -- the pool ------------------------------------------------------------------------------------------


def _pool(**kw: Any) -> tuple[BufferPool, list[int]]:
    made: list[int] = []

    def alloc(n: int) -> Any:
        made.append(n)
        return np.empty(n, np.uint8)

    return BufferPool(alloc, **kw), made


def test_pool_size_buckets() -> None:
    pool, _ = _pool(min_bucket=4096)
    assert [pool.bucket(n) for n in (0, 1, 4096, 4097, 8192, 8193, 1 << 20)] == [
        4096,
        4096,
        4096,
        8192,
        8192,
        16384,
        1 << 20,
    ]
    with pytest.raises(ValueError, match="power of two"):
        _pool(min_bucket=3000)


def test_pool_reuses_a_released_buffer_of_the_same_bucket() -> None:
    pool, made = _pool()
    a = pool.acquire(5000)
    assert a.size == 8192 and pool.in_use_bytes == 8192 and made == [8192]
    buf = a.buf
    pool.release(a)
    assert pool.cached_bytes == 8192 and pool.in_use_bytes == 0
    b = pool.acquire(7000)  # same bucket: the same buffer, nothing allocated
    assert b.buf is buf and made == [8192] and pool.hits == 1
    c = pool.acquire(100)  # another bucket: a new one
    assert c.buf is not buf and made == [8192, 4096] and pool.misses == 2
    pool.release(b)
    pool.release(b)  # a second release is ignored
    assert pool.cached_bytes == 8192 and pool.in_use_bytes == 4096


def test_pool_cache_is_bounded_and_oversized_buffers_are_not_pooled() -> None:
    pool, made = _pool(max_cached_bytes=16384)
    blocks = [pool.acquire(8192) for _ in range(3)]
    for blk in blocks:
        pool.release(blk)
    assert pool.cached_bytes == 16384  # the third did not fit: dropped
    big = pool.acquire(20000)  # larger than the whole cache: exact size, never cached
    assert big.size == 20000 and not big.pooled and made[-1] == 20000
    pool.release(big)
    assert pool.cached_bytes == 16384 and pool.in_use_bytes == 0
    # a buffer something may still write into is discarded, never reused
    d = pool.acquire(8192)
    pool.discard(d)
    assert pool.cached_bytes == 8192 and pool.in_use_bytes == 0


def test_pool_close_frees_the_cache_and_refuses_more() -> None:
    pool, _ = _pool()
    a, b = pool.acquire(10), pool.acquire(10)
    pool.release(a)
    pool.close()
    assert pool.closed and pool.cached_bytes == 0
    pool.release(b)  # an operation finishing after close: dropped
    assert pool.cached_bytes == 0 and pool.in_use_bytes == 0
    with pytest.raises(dist.DistError, match="destroy_process_group"):
        pool.acquire(10)


# -- every operation staged, ranks as tasks over the memory transport --------------------------------------


def _makers() -> list[Any]:
    makers: list[Any] = [lambda a: np.ascontiguousarray(a).copy()]
    if torch is not None:
        makers.append(lambda a: torch.from_numpy(np.ascontiguousarray(a).copy()))
    return makers


def _host(t: Any) -> np.ndarray:
    return t.numpy() if hasattr(t, "numpy") else np.asarray(t)


async def _all_ops(g: ProcessGroup, mk: Any) -> dict[str, Any]:
    n, r, gr = g.size, g.rank, g.ranks
    out: dict[str, Any] = {}
    t = mk(np.arange(1001, dtype=np.float32) * (r + 1))
    await dist.all_reduce(t, group=g)
    out["all_reduce"] = bool((_host(t) == np.arange(1001) * n * (n + 1) / 2).all())
    b = mk(np.arange(5, dtype=np.int64) if r == n - 1 else np.zeros(5, np.int64))
    await dist.broadcast(b, gr[n - 1], group=g)
    out["broadcast"] = _host(b).tolist()
    c = mk(np.full(3, r + 1, np.int32))
    await dist.reduce(c, gr[0], dist.ReduceOp.PRODUCT, group=g)
    out["reduce"] = _host(c).tolist()
    lst = [mk(np.zeros(2, np.float64)) for _ in range(n)]
    await dist.all_gather(lst, mk(np.full(2, float(r))), group=g)
    out["all_gather"] = [float(_host(x)[0]) for x in lst]
    flat = mk(np.zeros(2 * n, np.int16))
    await dist.all_gather_into_tensor(flat, mk(np.full(2, r, np.int16)), group=g)
    out["all_gather_into_tensor"] = _host(flat).tolist()
    gl = [mk(np.zeros(1, np.uint8)) for _ in range(n)] if r == 0 else None
    await dist.gather(mk(np.full(1, r, np.uint8)), gl, gr[0], group=g)
    out["gather"] = [int(_host(x)[0]) for x in gl] if gl else None
    s = mk(np.zeros(1, np.int64))
    await dist.scatter(
        s, [mk(np.full(1, 7 * i, np.int64)) for i in range(n)] if r == 0 else None, gr[0], group=g
    )
    out["scatter"] = int(_host(s)[0])
    rs = mk(np.zeros(2, np.float32))
    await dist.reduce_scatter(rs, [mk(np.full(2, i + r, np.float32)) for i in range(n)], group=g)
    out["reduce_scatter"] = _host(rs).tolist()
    rst = mk(np.zeros(1, np.int64))
    await dist.reduce_scatter_tensor(rst, mk(np.arange(n, dtype=np.int64)), dist.ReduceOp.MAX, group=g)
    out["reduce_scatter_tensor"] = int(_host(rst)[0])
    a2a = [mk(np.zeros(s + 1, np.int32)) for s in range(n)]
    await dist.all_to_all(a2a, [mk(np.full(r + 1, 10 * r + d, np.int32)) for d in range(n)], group=g)
    out["all_to_all"] = [_host(x).tolist() for x in a2a]
    single = mk(np.zeros(n, np.int32))
    await dist.all_to_all_single(single, mk(np.arange(n, dtype=np.int32) + 10 * r), group=g)
    out["all_to_all_single"] = _host(single).tolist()
    if n > 1:
        got = mk(np.zeros(4, np.float32))
        sent = dist.isend(mk(np.full(4, r, np.float32)), gr[(r + 1) % n], group=g)
        out["recv_from"] = await dist.irecv(got, None, group=g)
        await sent
        out["p2p"] = _host(got).tolist()
    return out


def _check_all_ops(res: list[dict[str, Any]], n: int) -> None:
    for r, out in enumerate(res):
        assert out["all_reduce"]
        assert out["broadcast"] == [0, 1, 2, 3, 4]
        assert out["reduce"] == ([int(np.prod(np.arange(1, n + 1)))] * 3 if r == 0 else [r + 1] * 3)
        assert out["all_gather"] == [float(i) for i in range(n)]
        assert out["all_gather_into_tensor"] == [i for i in range(n) for _ in range(2)]
        assert out["gather"] == (list(range(n)) if r == 0 else None)
        assert out["scatter"] == 7 * r
        assert out["reduce_scatter"] == [float(n * r + sum(range(n)))] * 2
        assert out["reduce_scatter_tensor"] == r
        assert out["all_to_all"] == [[10 * s + r] * (s + 1) for s in range(n)]
        assert out["all_to_all_single"] == [10 * s + r for s in range(n)]
        if n > 1:
            assert out["recv_from"] == (r - 1) % n
            assert out["p2p"] == [float((r - 1) % n)] * 4


@pytest.mark.parametrize("n", [1, 2, 3])
async def test_every_operation_staged_through_host_buffers(n: int) -> None:
    fabric, groups = memory_world(n)
    stagers = [HostStager() for _ in groups]
    for g, s in zip(groups, stagers, strict=True):
        g.stager = s
    try:
        for mk in _makers():
            res = await asyncio.wait_for(asyncio.gather(*(_all_ops(g, mk) for g in groups)), 60)
            _check_all_ops(list(res), n)
        for s in stagers:
            # Twins are poisoned: right results mean every input was copied in before the
            # algorithm read it, and every output copied back before its Work completed.
            assert s.copies_in > 0 and s.copies_out > 0
            assert s.pool.in_use_bytes == 0 and s.pool.cached_bytes > 0
            assert s.pool.hits > 0  # the second pass reused the first one's buffers
    finally:
        for t in fabric.transports:
            t.abort()


async def test_staging_keeps_the_call_order_when_only_some_ranks_stage() -> None:
    # Rank 0 stages, rank 1 does not: the staged call still takes its sequence number at the
    # call, so back-to-back collectives match across ranks.
    fabric, groups = memory_world(2)
    groups[0].stager = HostStager()
    try:

        async def run(g: ProcessGroup) -> list[list[float]]:
            a, b = np.full(3, g.rank + 1.0), np.full(3, 10.0 * (g.rank + 1))
            await asyncio.gather(dist.all_reduce(a, group=g), dist.all_reduce(b, dist.ReduceOp.MAX, group=g))
            return [a.tolist(), b.tolist()]

        res = await asyncio.wait_for(asyncio.gather(*(run(g) for g in groups)), 30)
        assert res == [[[3.0] * 3, [20.0] * 3]] * 2
    finally:
        for t in fabric.transports:
            t.abort()


async def test_a_failed_staged_operation_drops_its_buffers_and_leaves_the_tensor() -> None:
    fabric, groups = memory_world(2)
    stager = HostStager()
    groups[0].stager = stager
    try:
        t = np.full(4, 5.0)
        with pytest.raises(dist.DistTimeoutError):
            await dist.recv(t, 1, group=groups[0], timeout=0.2)  # nobody sends
        assert t.tolist() == [5.0] * 4  # the poisoned twin was not copied back
        assert stager.pool.in_use_bytes == 0 and stager.pool.cached_bytes == 0
        with pytest.raises(dist.DistValueError, match="read-only"):
            ro = np.zeros(2)
            ro.flags.writeable = False
            dist.all_reduce(ro, group=groups[0])
        assert stager.pool.in_use_bytes == 0
    finally:
        for tr in fabric.transports:
            tr.abort()


# -- the CUDA path, on CPU: a tensor the tensor layer refuses (as it refuses CUDA ones) ------------------


@needs_torch
async def test_device_tensors_are_staged_through_the_exception_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # "Device" tensors are CPU tensors marked here; the tensor layer refuses them as it refuses
    # CUDA tensors (DeviceTensorError), and the operation is re-run staged, as on a GPU.
    marked: set[int] = set()
    monkeypatch.setattr(_tensors, "_is_cuda", lambda obj: id(obj) in marked)

    class DeviceStager(HostStager):
        stages_host_tensors = False  # like CudaStager: only what the tensor layer refuses

        def wants(self, obj: object) -> bool:
            return id(obj) in marked

        def stage(self, obj: Any, **kw: Any) -> _staging.Staged:
            marked.discard(id(obj))  # copy it as the host tensor it really is
            try:
                return super().stage(obj, **kw)
            finally:
                marked.add(id(obj))

    fabric, groups = memory_world(2)
    stagers = [DeviceStager() for _ in groups]
    for g, s in zip(groups, stagers, strict=True):
        g.stager = s
    try:

        async def run(g: ProcessGroup) -> list[Any]:
            t = torch.full((3,), float(g.rank + 1))
            marked.add(id(t))
            outs = [torch.zeros(2) for _ in range(2)]
            marked.update(id(o) for o in outs)
            inp = torch.full((2,), float(g.rank))
            marked.add(id(inp))
            plain = np.ones(2)  # not a device tensor: the common path
            await asyncio.gather(
                dist.all_reduce(t, group=g),
                dist.all_gather(outs, inp, group=g),
                dist.all_reduce(plain, group=g),
            )
            return [t.tolist(), [o.tolist() for o in outs], plain.tolist()]

        res = await asyncio.wait_for(asyncio.gather(*(run(g) for g in groups)), 30)
        assert res == [[[3.0] * 3, [[0.0, 0.0], [1.0, 1.0]], [2.0, 2.0]]] * 2
        assert all(s.copies_in == 2 and s.copies_out == 3 for s in stagers)  # t in/out, inp in, outs out
        # Without a stager (a group not made by init_process_group), a clear error.
        dev = torch.zeros(2)
        marked.add(id(dev))
        groups[1].stager = None
        with pytest.raises(dist.DistValueError, match=r"is a CUDA tensor .*staging"):
            dist.all_reduce(dev, group=groups[1])
    finally:
        for tr in fabric.transports:
            tr.abort()


def test_one_device_per_call() -> None:
    _staging.check_one_device([("a", np.zeros(1)), ("b", None), ("c", np.zeros(2))])
    if torch is not None:
        with pytest.raises(dist.DistValueError, match=r"output is on cpu but input\[1\] is on meta"):
            _staging.check_one_device(
                [
                    ("output", torch.zeros(1)),
                    ("input[0]", np.zeros(1)),
                    ("input[1]", torch.zeros(1, device="meta")),
                ]
            )


# -- the job's stager: installed on every group, freed by destroy_process_group ------------------------------


async def test_pool_released_on_destroy() -> None:
    await dist.init_process_group("tcp", store=HashStore(), rank=0, world_size=1)
    try:
        default = _world.world().stager
        assert (
            isinstance(default, _staging.CudaStager) and default.pool.cached_bytes == 0
        )  # nothing allocated
        stager = HostStager()
        assert _world.set_stager(stager) is default
        sub = await dist.new_group([0])
        assert sub.stager is stager
        t = np.arange(10.0)
        await dist.all_reduce(t)
        await dist.broadcast(t, 0, group=sub)
        assert stager.pool.cached_bytes > 0 and stager.copies_out == 2
    finally:
        await dist.destroy_process_group()
    assert stager.pool.closed and stager.pool.cached_bytes == 0


# -- over TCP, real processes, both faces ---------------------------------------------------------------------


def test_staged_async_face_over_tcp() -> None:
    kinds = ("numpy", "torch") if torch is not None else ("numpy",)
    res = spawn(async_suite, 2, args=("tcp", kinds, True), timeout=80)
    check_async_suite(res, 2, kinds)
    for out in res:
        copies_in, copies_out, hits, in_use = out["stager"]
        assert copies_in > 0 and copies_out > 0 and hits > 0 and in_use == 0
        assert out["pool_after_destroy"] == (True, 0)


@needs_torch
def test_staged_sync_face_over_tcp() -> None:
    res = spawn(sync_suite, 2, args=("tcp", "cpu", True), timeout=80)
    check_sync_suite(res, 2)
