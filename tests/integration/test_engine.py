"""torch's engines behind aiodist's API, tested through torch's gloo engine (backend "torch-gloo"):
the collective suite in both faces over real processes, awaited from asyncio; Work semantics,
timeouts and errors on engines built in this process; the store as torch sees it."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tdist = pytest.importorskip("torch.distributed")

from support.suite import async_suite, check_async_suite, check_sync_suite, sync_suite  # noqa: E402
from support.worlds import backend_world  # noqa: E402

import aiodist as dist  # noqa: E402
from aiodist.backends import torch_engine as _engine  # noqa: E402
from aiodist.store import HashStore, PrefixStore  # noqa: E402
from aiodist.testing import memory_world, spawn  # noqa: E402

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(not hasattr(tdist, "ProcessGroupGloo"), reason="torch built without gloo"),
]


# -- the suite, real processes --------------------------------------------------------------------


def test_async_face_over_torch_gloo_3_ranks() -> None:
    kinds = ("numpy", "torch")
    res = spawn(async_suite, 3, args=("torch-gloo", kinds), timeout=80)
    check_async_suite(res, 3, kinds)
    assert all(out["backend"] == "torch-gloo" for out in res)
    assert "numpy:recv_any" in res[0] and "torch:recv_any" in res[0]


def test_sync_face_over_torch_gloo_2_ranks() -> None:
    res = spawn(sync_suite, 2, args=("torch-gloo",), timeout=80)
    check_sync_suite(res, 2)
    assert all(out["backend"] == "torch-gloo" for out in res)


# -- engines in this process: two ranks over one store --------------------------------------------


async def _engines(n: int, timeout: float = 30.0) -> tuple[Any, list[_engine.TorchEngine]]:
    store = HashStore()
    backends = [
        _engine.TorchBackend("torch-gloo", PrefixStore("e/", store), host="127.0.0.1") for _ in range(n)
    ]
    fabric, groups = backend_world(backends, timeout)
    await asyncio.gather(*(b.connect(g) for b, g in zip(backends, groups, strict=True)))
    return fabric, [b.engine for b in backends if b.engine is not None]


async def _close(fabric: Any, engines: list[_engine.TorchEngine]) -> None:
    await asyncio.gather(*(e.aclose() for e in engines))
    for t in fabric.transports:
        t.abort()


async def test_work_completes_from_torch_future_without_polling() -> None:
    fabric, engines = await _engines(2)
    try:
        groups = [e.group for e in engines]
        ts = [torch.full((4,), float(i + 1)) for i in range(2)]
        loop_thread = threading.current_thread()
        works = [dist.all_reduce(t, group=g) for t, g in zip(ts, groups, strict=True)]
        # Completion comes from torch's thread through call_soon_threadsafe: never during the call.
        assert not any(w.is_completed() for w in works)
        assert await asyncio.gather(*works) == [None, None]
        assert all(w.is_completed() and w.is_success() and w.exception() is None for w in works)
        assert [t.tolist() for t in ts] == [[3.0] * 4] * 2
        # wait() from another thread, get_future(), awaiting twice
        a = np.arange(3, dtype=np.int64)
        b = np.arange(3, dtype=np.int64)
        wa, wb = dist.all_reduce(a, group=groups[0]), dist.all_reduce(b, group=groups[1])
        assert await asyncio.to_thread(wa.wait) is True
        assert await asyncio.wrap_future(wb.get_future()) is None
        assert await wb is None and (a == [0, 2, 4]).all() and (b == a).all()
        # A task awaiting a Work may be cancelled: the operation goes on.
        c = [torch.ones(2) for _ in range(2)]
        wc = [dist.all_reduce(x, group=g) for x, g in zip(c, groups, strict=True)]
        waiter = asyncio.ensure_future(wc[0])
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.gather(*wc)
        assert [x.tolist() for x in c] == [[2.0, 2.0]] * 2
        # recv: from a given rank, and from any rank (gloo's p2p works have no future: a thread waits)
        got = torch.zeros(2)
        sent = dist.send(torch.full((2,), 5.0), 1, group=groups[0], tag=7)
        assert await dist.recv(got, None, group=groups[1], tag=7) == 0
        await sent
        assert got.tolist() == [5.0, 5.0]
        assert threading.current_thread() is loop_thread
    finally:
        await _close(fabric, engines)


async def test_engine_timeout_and_errors() -> None:
    fabric, engines = await _engines(2)
    try:
        g0, g1 = engines[0].group, engines[1].group
        # Argument errors are raised at the call, as aiodist's own: ValueError / TypeError.
        with pytest.raises(dist.DistValueError, match="is not a member"):
            dist.broadcast(torch.zeros(1), 5, group=g0)
        with pytest.raises(dist.DistTypeError, match="BXOR"):
            dist.all_reduce(torch.zeros(2), dist.ReduceOp.BXOR, group=g0)
        with pytest.raises(dist.DistValueError, match="one tensor per group member"):
            dist.all_gather([torch.zeros(1)], torch.zeros(1), group=g0)
        with pytest.raises(dist.DistValueError, match="contiguous"):
            dist.all_reduce(torch.zeros(3, 3).t(), group=g0)
        with pytest.raises(dist.DistValueError, match="own rank"):
            dist.send(torch.zeros(1), 0, group=g0)
        with pytest.raises(
            dist.DistValueError, match="on meta, but backend 'torch-gloo' runs CPU tensors only"
        ):
            dist.all_reduce(torch.zeros(2, device="meta"), group=g0)
        # A timeout fails the Work with DistTimeoutError (rank 1 never joins).
        with pytest.raises(dist.DistTimeoutError, match=r"all_reduce #\d+ on rank 0 .*reached its timeout"):
            await dist.all_reduce(torch.ones(2), group=g0, timeout=0.5)
        del g1
    finally:
        await _close(fabric, engines)


async def test_destroying_an_engine_fails_its_pending_work() -> None:
    fabric, engines = await _engines(2)
    try:
        pending = dist.all_reduce(torch.ones(2), group=engines[0].group)  # rank 1 never joins
        await engines[0].aclose("the process group was destroyed")
        with pytest.raises(dist.DistError, match="destroyed"):
            await pending
    finally:
        await _close(fabric, engines)


async def test_nccl_rules_without_a_gpu() -> None:
    # The device rules of the adapter, on an engine that is never started.
    _, groups = memory_world(1)
    engine = _engine.TorchEngine("nccl", None, groups[0])
    with pytest.raises(
        dist.DistValueError, match=r"tensor is on cpu, but backend 'nccl' runs CUDA tensors only"
    ):
        engine.all_reduce(torch.zeros(2))
    with pytest.raises(dist.DistValueError, match=r"numpy array.*'nccl' runs CUDA tensors only"):
        engine.broadcast(np.zeros(2), 0)
    gloo = _engine.TorchEngine("torch-gloo", None, groups[0])
    with pytest.raises(dist.DistValueError, match="'torch-gloo' runs CPU tensors only"):
        gloo.all_reduce(torch.zeros(2, device="meta"))


async def test_init_nccl_without_cuda_is_a_clear_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(dist.DistValueError, match="backend 'nccl' needs CUDA"):
        await dist.init_process_group("nccl", store=HashStore(), rank=0, world_size=1)
    with pytest.raises(dist.DistValueError, match="no CUDA"):
        await dist.init_process_group("tcp", store=HashStore(), rank=0, world_size=1, device_id="cuda:0")
    with pytest.raises(ValueError, match="torch-gloo"):
        await dist.init_process_group("mpi", store=HashStore(), rank=0, world_size=1)
    assert not dist.is_initialized()
    import aiodist.sync as sd

    assert not sd.is_nccl_available() and not sd.is_backend_available("nccl")
    assert sd.is_backend_available("torch-gloo")


async def test_one_rank_torch_gloo_world_and_mixed_groups() -> None:
    await dist.init_process_group("torch-gloo", store=HashStore(), rank=0, world_size=1, device_id="cpu")
    try:
        assert dist.get_backend() == "torch-gloo"
        t = torch.arange(4.0)
        await dist.all_reduce(t)
        await dist.broadcast(t, 0)
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
        # A group on aiodist's own transport inside an engine job, and the reverse.
        plain = await dist.new_group([0], backend="gloo")
        assert plain.runs_on.own_ops is None and dist.get_backend(plain) == "tcp"
        await dist.all_reduce(t, group=plain)
        engine_group = await dist.new_group(backend="torch-gloo")
        assert isinstance(engine_group.runs_on.own_ops, _engine.TorchEngine)
        await dist.barrier(group=engine_group)
    finally:
        await dist.destroy_process_group()


# -- the store, as torch sees it ------------------------------------------------------------------


async def test_torch_store_adapter_blocks_on_the_loop_from_other_threads() -> None:
    store = HashStore()
    ts = _engine.torch_store(store, asyncio.get_running_loop())
    assert isinstance(ts, tdist.Store)

    def from_torch_thread() -> list[Any]:
        ts.set("a", b"1")
        out: list[Any] = [ts.get("a"), ts.add("n", 5), ts.add("n", 2)]
        out.append(ts.compare_set("c", b"", b"x"))
        out.append(ts.check(["a", "c"]))
        ts.wait(["a"])
        ts.multi_set(["m1", "m2"], [b"p", b"q"])
        out.append(ts.multi_get(["m1", "m2"]))
        ts.append("a", b"2")
        out.append(ts.get("a"))
        out.append(ts.delete_key("c"))
        out.append(ts.num_keys())
        # torch's own C++ PrefixStore calls back into the Python methods.
        prefixed = tdist.PrefixStore("p", ts)
        prefixed.set("k", "v")
        out.append(ts.get("p/k"))
        return out

    got = await asyncio.to_thread(from_torch_thread)
    assert got[:9] == [b"1", 5, 7, b"x", True, [b"p", b"q"], b"12", True, await store.num_keys() - 1]
    assert got[9] == b"v"
    assert await store.get("a") == b"12"
    # On the loop's own thread it would wait for itself: a clear error instead of a hang.
    with pytest.raises(dist.DistStoreError, match="loop's own thread"):
        ts.get("a")
