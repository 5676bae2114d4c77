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
    # The device rules of the backend, on an engine that is never started: the group refuses the
    # call while it checks the arguments, before anything reaches torch.
    for backend in ("nccl", "torch-gloo"):
        b = _engine.TorchBackend(backend, HashStore(), host="127.0.0.1")
        _, (g,) = backend_world([b])
        b.engine = _engine.TorchEngine(backend, None, g)
        if backend == "nccl":
            with pytest.raises(
                dist.DistValueError, match=r"tensor is on cpu, but backend 'nccl' runs CUDA tensors only"
            ):
                dist.all_reduce(torch.zeros(2), group=g)
            with pytest.raises(dist.DistValueError, match=r"numpy array.*'nccl' runs CUDA tensors only"):
                dist.broadcast(np.zeros(2), 0, group=g)
            with pytest.raises(dist.DistValueError, match=r"input_tensor is on cpu.*'nccl'"):
                dist.all_gather_into_tensor(torch.zeros(2), torch.zeros(2), group=g)
        else:
            with pytest.raises(dist.DistValueError, match="'torch-gloo' runs CPU tensors only"):
                dist.all_reduce(torch.zeros(2, device="meta"), group=g)
            with pytest.raises(dist.DistValueError, match=r"tensor_list\[0\] is on meta.*'torch-gloo'"):
                dist.all_gather([torch.zeros(1, device="meta")], torch.zeros(1), group=g)


# -- the group's checks, numbering and timeouts, shared with every backend -------------------------


def _bad_calls(g: Any) -> list[tuple[str, Any]]:
    """Calls that every backend refuses while the group checks them (group ``g`` of 2 ranks, on rank 0)."""
    z = torch.zeros
    return [
        ("broadcast src", lambda: dist.broadcast(z(2), 5, group=g)),
        ("all_reduce op", lambda: dist.all_reduce(z(2), dist.ReduceOp.BXOR, group=g)),
        ("all_reduce dtype", lambda: dist.all_reduce(z(2, dtype=torch.uint32), group=g)),
        ("all_reduce strided", lambda: dist.all_reduce(z(3, 3).t(), group=g)),
        ("all_reduce type", lambda: dist.all_reduce([1.0], group=g)),
        ("all_gather length", lambda: dist.all_gather([z(1)], z(1), group=g)),
        ("all_gather dtype", lambda: dist.all_gather([z(1), z(1, dtype=torch.int32)], z(1), group=g)),
        ("all_gather size", lambda: dist.all_gather([z(1), z(2)], z(1), group=g)),
        ("into_tensor size", lambda: dist.all_gather_into_tensor(z(3), z(2), group=g)),
        ("gather list on root", lambda: dist.gather(z(1), None, 0, group=g)),
        ("gather list off root", lambda: dist.gather(z(1), [z(1), z(1)], 1, group=g)),
        ("scatter list", lambda: dist.scatter(z(1), None, 0, group=g)),
        ("reduce_scatter", lambda: dist.reduce_scatter(z(2), [z(2), z(3)], group=g)),
        ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(z(2), z(5), group=g)),
        ("all_to_all own block", lambda: dist.all_to_all([z(1), z(1)], [z(2), z(1)], group=g)),
        ("all_to_all_single uneven", lambda: dist.all_to_all_single(z(3), z(3), group=g)),
        ("all_to_all_single splits", lambda: dist.all_to_all_single(z(3), z(3), [1, 1], [2, 1], group=g)),
        ("send to self", lambda: dist.send(z(1), 0, group=g)),
        ("send tag", lambda: dist.send(z(1), 1, group=g, tag="x")),
        ("recv src", lambda: dist.recv(z(1), 7, group=g)),
    ]


def _refusal(call: Any) -> tuple[type[BaseException], str]:
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    return type(info.value), str(info.value)


async def test_torch_gloo_refuses_bad_arguments_as_tcp_does() -> None:
    fabric, engines = await _engines(2)
    try:
        _, tcp_groups = memory_world(2)
        engine_group, tcp_group = engines[0].group, tcp_groups[0]
        for (what, on_engine), (_, on_tcp) in zip(
            _bad_calls(engine_group), _bad_calls(tcp_group), strict=True
        ):
            assert _refusal(on_engine) == _refusal(on_tcp), what
        # What only torch's engine cannot compute is refused too, before it is numbered.
        with pytest.raises(dist.DistTypeError, match="PRODUCT on complex tensors"):
            dist.all_reduce(torch.ones(2, dtype=torch.complex64), dist.ReduceOp.PRODUCT, group=engine_group)
        # Nothing refused took a number: the next collective is #0 on both ranks, and matches.
        ts = [torch.full((2,), float(i)) for i in range(2)]
        works = [dist.all_reduce(t, group=e.group) for t, e in zip(ts, engines, strict=True)]
        assert [w.name for w in works] == ["all_reduce #0"] * 2
        await asyncio.gather(*works)
        assert [t.tolist() for t in ts] == [[1.0, 1.0]] * 2
    finally:
        await _close(fabric, engines)


async def test_torch_gloo_timeout_is_the_groups_and_starts_no_resync() -> None:
    fabric, engines = await _engines(2)
    try:
        g0, g1 = engines[0].group, engines[1].group
        # Object collectives (aiodist's transport) and engine operations share the group's numbering.
        objs = [["a"], [None]]
        await asyncio.gather(
            *(dist.broadcast_object_list(o, 0, group=g) for o, g in zip(objs, (g0, g1), strict=True))
        )
        assert objs[1] == ["a"]
        # Rank 1 enters the all_reduce only after rank 0's timeout: rank 0 fails with the group's
        # DistTimeoutError...
        with pytest.raises(
            dist.DistTimeoutError,
            match=r"all_reduce #1 on rank 0 \(default group\) reached its timeout of 0.5 s",
        ):
            await dist.all_reduce(torch.ones(2), group=g0, timeout=0.5)
        # ...and asks no member where it stands (a native group would: rank 1, which never
        # entered it, would find the group out of step and refuse its next collective).
        await asyncio.sleep(0.3)
        assert g0.out_of_step is None and g1.out_of_step is None
        late = dist.all_reduce(torch.ones(2), group=g1, timeout=0.5)  # not refused by the group
        assert late.name == "all_reduce #1"
        with pytest.raises(dist.DistError):  # torch's engine closed its pairs after rank 0's timeout
            await late
        # The group goes on: both ranks are at the same place, its transport's collectives work.
        objs = [[1, 2], [None, None]]
        await asyncio.gather(
            *(dist.broadcast_object_list(o, 0, group=g) for o, g in zip(objs, (g0, g1), strict=True))
        )
        assert objs[1] == [1, 2] and g0.broken is None and g1.broken is None
    finally:
        await _close(fabric, engines)


async def test_detail_mode_checks_engine_operations_before_torch_sees_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AIODIST_DEBUG", "DETAIL")
    fabric, engines = await _engines(2)
    try:
        g0, g1 = engines[0].group, engines[1].group
        ts = [torch.full((3,), 2.0), torch.full((3,), 5.0)]
        await asyncio.gather(dist.all_reduce(ts[0], group=g0), dist.all_reduce(ts[1], group=g1))
        assert [t.tolist() for t in ts] == [[7.0] * 3] * 2
        # The ranks disagree (sizes): every rank says so, from the group's check of the
        # fingerprints, and torch's engine is never given the mismatched call.
        works = [dist.all_reduce(torch.ones(3), group=g0), dist.all_reduce(torch.ones(4), group=g1)]
        for w in works:
            with pytest.raises(dist.CollectiveMismatchError, match="all_reduce"):
                await w
    finally:
        await _close(fabric, engines)


async def test_engine_errors_are_classified_by_type_where_torch_has_one() -> None:
    fabric, engines = await _engines(1)
    try:
        e = engines[0]

        def mapped(exc: BaseException) -> BaseException:
            err = e._map_error(exc, "all_reduce #3")
            assert err.__cause__ is exc and "all_reduce #3 on rank 0 (default group)" in str(err)
            return err

        assert type(mapped(tdist.DistNetworkError("x"))) is dist.DistNetworkError
        assert type(mapped(tdist.DistStoreError("x"))) is dist.DistStoreError
        assert type(mapped(tdist.DistError("x"))) is dist.DistError
        # gloo's plain RuntimeErrors, by their text (torch 2.13's messages)
        timed_out = (
            "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 500ms for recv operation to complete"
        )
        closed = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:21130"
        assert type(mapped(RuntimeError(timed_out))) is dist.DistTimeoutError
        assert type(mapped(RuntimeError("Application timeout caused pair closure"))) is dist.DistTimeoutError
        assert type(mapped(RuntimeError(closed))) is dist.DistNetworkError
        assert type(mapped(RuntimeError("something else"))) is dist.DistError
        # NCCL's watchdog reports a timeout as a DistBackendError
        watchdog = "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3) ran for 500 milliseconds"
        assert type(mapped(tdist.DistBackendError(watchdog))) is dist.DistTimeoutError
    finally:
        await _close(fabric, engines)


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


async def test_a_kind_torchs_engine_does_not_run_is_refused_and_its_number_given_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from support.declared import declare_test_operations

    declare_test_operations(monkeypatch)
    fabric, engines = await _engines(2)
    try:
        groups = [e.group for e in engines]
        for g in groups:
            with pytest.raises(dist.DistValueError, match="ring_shift is not run by torch's gloo engine"):
                g.collective("shift", torch.zeros(2), torch.ones(2))
        # An operation over a kind it runs goes through, numbered as if nothing had been refused.
        ts = [torch.full((2,), float(r + 1)) for r in range(2)]
        await asyncio.gather(*(g.collective("sum_all", t) for g, t in zip(groups, ts, strict=True)))
        await asyncio.gather(*(dist.barrier(group=g) for g in groups))
        assert [t.tolist() for t in ts] == [[3.0, 3.0]] * 2
    finally:
        await _close(fabric, engines)
