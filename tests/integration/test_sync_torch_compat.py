"""What torch's own distributed test suite expects of ``aiodist.sync``, each point on its own.

One job of three real processes (the blocking face over loopback) runs every check and reports
what it saw; each test below asserts one point of it. The checks: debug levels, the coalesced
collectives, sparse ``all_reduce``, torch's exception classes, profiler records, a non-member's
``monitored_barrier``, objects holding tensors/arrays without pickle (and without a secret),
non-contiguous tensors, and ``new_group``'s ``sort_ranks`` / ``use_local_synchronization``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from typing import Any

import numpy as np
import pytest

import aiodist.sync as dist
from aiodist.errors import UnsupportedReduceError
from aiodist.testing import spawn

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(180)


def _check(out: dict[str, Any], name: str, fn: Any) -> None:
    """Run one check; record its result, or the error it raised, under ``name``."""
    try:
        out[name] = fn()
    except Exception as exc:
        out[name] = f"FAILED {type(exc).__name__}: {exc}"


def _coalesced(rank: int, size: int) -> Any:
    tensors = [torch.full((2,), float(rank + 1)), torch.full((3, 3), complex(rank, 1)), torch.ones(0)]
    dist.all_reduce_coalesced(tensors, dist.ReduceOp.SUM)
    inputs = [torch.full((1,), float(rank)), torch.arange(4.0).reshape(2, 2) + rank]
    outputs = [[torch.empty(1), torch.empty(2, 2)] for _ in range(size)]
    work = dist.all_gather_coalesced(outputs, inputs, async_op=True)
    assert work is not None
    work.wait()
    return {
        "reduced": [t.tolist() for t in tensors],
        "gathered": [[o.tolist() for o in row] for row in outputs],
    }


def _sparse(rank: int, size: int) -> Any:
    # Rank r holds ones at rows 0..r of a (size, 2) tensor: the indices overlap between ranks.
    idx = torch.arange(rank + 1).reshape(1, -1)
    t = torch.sparse_coo_tensor(idx, torch.ones(rank + 1, 2), (size, 2))
    dist.all_reduce(t)
    return {"dense": t.to_dense().tolist(), "is_sparse": t.is_sparse, "coalesced": t.is_coalesced()}


def _exceptions() -> Any:
    caught = {}
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT, dist.ReduceOp.BXOR):
        try:
            dist.all_reduce(torch.ones(2, dtype=torch.cfloat), op)
        except ValueError as exc:  # torch raises ValueError: code written for it must catch ours
            caught[op.name] = (type(exc).__name__, str(exc))
    try:
        dist.all_reduce(torch.ones(2), dist.ReduceOp.BAND)  # bitwise on floats: refused before sending
    except ValueError as exc:
        caught["BAND_float"] = (type(exc).__name__, str(exc))
    try:
        dist.scatter_object_list([], [1, 2, 3], src=0)
    except ValueError as exc:
        caught["scatter_object_list"] = (type(exc).__name__, str(exc))
    return caught


def _profiler(rank: int, size: int) -> Any:
    t = torch.ones(3, 3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        dist.all_reduce(t)
        if rank == 0:
            dist.send(torch.ones(2, 2), 1)
        elif rank == 1:
            dist.recv(torch.empty(2, 2), 0)
        dist.all_gather([torch.empty(3, 3) for _ in range(size)], t, async_op=True).wait()
    events = [e for e in prof.events() if e.name.startswith("gloo:")]
    return sorted((e.name, e.is_async, e.count, [list(s) for s in e.input_shapes]) for e in events)


def _non_member_monitored_barrier(rank: int, sub: Any) -> Any:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = dist.monitored_barrier(sub, timeout=10)
    return {"result": result, "warned": [str(w.message) for w in seen]}


def _objects(rank: int, size: int) -> Any:
    assert "AIODIST_SECRET" not in os.environ and "AIODIST_ALLOW_PICKLE" not in os.environ
    obj = {
        "tensor": torch.arange(6.0).reshape(2, 3) * rank,
        "view": torch.arange(6).reshape(2, 3).t(),  # non-contiguous
        "array": np.arange(4, dtype=np.int16) + rank,
        "pair": (rank, "x"),
        "grad": torch.ones(2, requires_grad=True),
    }
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, obj)
    got = gathered[(rank + 1) % size]
    peer = (rank + 1) % size
    return {
        "tensor_equal": bool(torch.equal(got["tensor"], torch.arange(6.0).reshape(2, 3) * peer)),
        "view_equal": bool(torch.equal(got["view"], torch.arange(6).reshape(2, 3).t())),
        "array": (type(got["array"]).__name__, str(got["array"].dtype), got["array"].tolist()),
        "pair": (type(got["pair"]).__name__, list(got["pair"])),
        "grad": bool(got["grad"].requires_grad),
    }


def _non_contiguous(rank: int, size: int) -> Any:
    t = torch.arange(6.0).reshape(2, 3).t()  # (3, 2), not contiguous
    dist.all_reduce(t)
    a = (np.arange(6.0).reshape(2, 3) + rank).T  # numpy, not C-contiguous
    work = dist.all_reduce(a, async_op=True)
    assert work is not None
    work.wait()
    recv = torch.zeros(2, 4)[:, ::2]  # strided: every other column
    if rank == 0:
        dist.send(torch.arange(4.0).reshape(2, 2).t(), 1)
        dist.isend(torch.arange(4.0).reshape(2, 2).t(), 1).wait()  # type: ignore[union-attr]
    elif rank == 1:
        dist.recv(recv, 0)
        recv2 = torch.zeros(2, 4)[:, ::2]
        dist.irecv(recv2, 0).wait()  # type: ignore[union-attr]
        assert torch.equal(recv2, recv)
    return {"torch": t.tolist(), "numpy": a.tolist(), "recv": recv.tolist()}


def _new_group_args(rank: int, size: int) -> Any:
    out: dict[str, Any] = {}
    reversed_group = dist.new_group([2, 1, 0], sort_ranks=False)
    out["group_rank"] = dist.get_rank(reversed_group)
    out["group_ranks"] = dist.get_process_group_ranks(reversed_group)
    t = torch.tensor([float(rank)])
    dist.broadcast(t, group=reversed_group, group_src=0)  # group rank 0 is global rank 2
    out["broadcast_from"] = t.item()
    # Only ranks 0 and 1 create this one; rank 2 goes straight on to the next group.
    if rank in (0, 1):
        local = dist.new_group([0, 1], use_local_synchronization=True)
        x = torch.tensor([1.0])
        dist.all_reduce(x, group=local)
        out["local_sum"] = x.item()
    everyone = dist.new_group()  # created by all three after the local one: still in step
    y = torch.tensor([1.0])
    dist.all_reduce(y, group=everyone)
    out["after_sum"] = y.item()
    return out


def _job(rank: int, size: int) -> dict[str, Any]:
    for name in ("AIODIST_SECRET", "AIODIST_ALLOW_PICKLE"):
        os.environ.pop(name, None)
    dist.init_process_group("gloo", timeout=60)
    out: dict[str, Any] = {}
    _check(out, "coalesced", lambda: _coalesced(rank, size))
    _check(out, "sparse", lambda: _sparse(rank, size))
    _check(out, "exceptions", _exceptions)
    _check(out, "profiler", lambda: _profiler(rank, size))
    sub = dist.new_group([0, 1])
    if rank == 2:
        _check(out, "non_member", lambda: _non_member_monitored_barrier(rank, sub))
    else:
        dist.monitored_barrier(sub, timeout=10)
    _check(out, "objects", lambda: _objects(rank, size))
    _check(out, "non_contiguous", lambda: _non_contiguous(rank, size))
    _check(out, "new_group", lambda: _new_group_args(rank, size))
    dist.barrier()
    # Last: rank 1 stays away from this one, so the others' numbering of operations moves on.
    if rank == 1:
        time.sleep(5.0)  # alive (not lost) until well after the others' verdict
    else:
        _check(out, "monitored_wording", lambda: dist.monitored_barrier(timeout=1.0))
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def job() -> list[dict[str, Any]]:
    return spawn(_job, 3, timeout=150)


# -- debug level (in this process: the functions are local) ----------------------------------


def test_debug_level_functions_read_and_write_aiodist_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiodist.settings import detail_on

    monkeypatch.delenv("AIODIST_DEBUG", raising=False)
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    assert dist.get_debug_level() == dist.DebugLevel.OFF
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    assert dist.get_debug_level() == dist.DebugLevel.DETAIL and detail_on()
    dist.set_debug_level("info")
    assert dist.get_debug_level() == dist.DebugLevel.INFO and not detail_on()
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    dist.set_debug_level_from_env()
    assert dist.get_debug_level() == dist.DebugLevel.DETAIL and detail_on()
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "LOUD")
    with pytest.raises(ValueError, match="TORCH_DISTRIBUTED_DEBUG"):
        dist.set_debug_level_from_env()
    with pytest.raises(ValueError, match="not a debug level"):
        dist.set_debug_level(7)
    dist.set_debug_level(dist.DebugLevel.OFF)
    assert not detail_on()


def test_torch_debug_variable_is_read_at_import() -> None:
    env = {k: v for k, v in os.environ.items() if k != "AIODIST_DEBUG"}
    env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    code = "import aiodist.sync as d, os; print(d.get_debug_level(), os.environ['AIODIST_DEBUG'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["DebugLevel.DETAIL", "DETAIL"], out.stderr


# -- the job's points ----------------------------------------------------------------------------


def test_all_reduce_coalesced_and_all_gather_coalesced(job: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(job):
        got = res["coalesced"]
        assert not isinstance(got, str), got
        assert got["reduced"][0] == [6.0, 6.0]  # 1 + 2 + 3
        assert got["reduced"][1] == [[complex(3, 3)] * 3] * 3  # (0+1+2) + 3i
        assert got["reduced"][2] == []
        assert got["gathered"] == [
            [[float(r)], [[r + 0.0, r + 1.0], [r + 2.0, r + 3.0]]] for r in range(3)
        ], rank


def test_sparse_all_reduce_sums_and_coalesces(job: list[dict[str, Any]]) -> None:
    for res in job:
        got = res["sparse"]
        assert not isinstance(got, str), got
        assert got["dense"] == [[3.0, 3.0], [2.0, 2.0], [1.0, 1.0]]
        assert got["is_sparse"] and got["coalesced"]


def test_unsupported_ops_raise_value_errors_as_torch(job: list[dict[str, Any]]) -> None:
    caught = job[0]["exceptions"]
    assert not isinstance(caught, str), caught
    for op in ("MAX", "PRODUCT", "BXOR"):
        assert caught[op][1] == f"all_reduce does not support ReduceOp.{op} on complex tensors"
    assert caught["BAND_float"][0] == "UnsupportedReduceError"
    assert (
        "Expected argument scatter_object_output_list to be a list of size at least 1"
        in caught["scatter_object_list"][1]
    )
    assert issubclass(UnsupportedReduceError, ValueError) and issubclass(UnsupportedReduceError, TypeError)


def test_profiler_records_operations_as_gloo_names_them(job: list[dict[str, Any]]) -> None:
    names = {
        0: {"gloo:all_reduce", "gloo:send", "gloo:all_gather"},
        1: {"gloo:all_reduce", "gloo:recv", "gloo:all_gather"},
    }
    for rank in (0, 1):
        events = job[rank]["profiler"]
        assert not isinstance(events, str), events
        assert {e[0] for e in events} == names[rank]
        for name, is_async, count, shapes in events:
            assert is_async and count == 1, (name, is_async, count)
            assert shapes == ([[2, 2]] if name in ("gloo:send", "gloo:recv") else [[3, 3]]), (name, shapes)


def test_non_member_monitored_barrier_is_skipped(job: list[dict[str, Any]]) -> None:
    got = job[2]["non_member"]
    assert not isinstance(got, str), got
    assert got["result"] is None
    assert any("does not belong to the given group" in w for w in got["warned"]), got


def test_monitored_barrier_words_errors_as_torch(job: list[dict[str, Any]]) -> None:
    assert job[0]["monitored_wording"].startswith(
        "FAILED DistTimeoutError: Rank 1 failed to pass monitoredBarrier"
    )
    assert job[2]["monitored_wording"].startswith(
        "FAILED DistTimeoutError: Rank 2 successfully reached monitoredBarrier, but received errors while "
        "waiting for send/recv from rank 0"
    ), job[2]["monitored_wording"]


def test_objects_with_tensors_and_arrays_need_no_pickle(job: list[dict[str, Any]]) -> None:
    for res in job:
        got = res["objects"]
        assert not isinstance(got, str), got  # a pickle would have been refused: no secret is set
        assert got["tensor_equal"] and got["view_equal"] and got["grad"]
        assert got["array"][:2] == ("ndarray", "int16")
        assert got["pair"][0] == "tuple"


def test_non_contiguous_tensors_round_trip(job: list[dict[str, Any]]) -> None:
    expected = (np.arange(6.0).reshape(2, 3).T * 3).tolist()
    numpy_expected = (np.arange(6.0).reshape(2, 3).T * 3 + 3).tolist()  # + (0 + 1 + 2)
    for rank, res in enumerate(job):
        got = res["non_contiguous"]
        assert not isinstance(got, str), got
        assert got["torch"] == expected and got["numpy"] == numpy_expected
        if rank == 1:
            assert got["recv"] == [[0.0, 2.0], [1.0, 3.0]]


def test_new_group_sort_ranks_and_local_synchronization(job: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(job):
        got = res["new_group"]
        assert not isinstance(got, str), got
        assert got["group_ranks"] == [2, 1, 0] and got["group_rank"] == 2 - rank
        assert got["broadcast_from"] == 2.0
        assert got["after_sum"] == 3.0
        if rank in (0, 1):
            assert got["local_sum"] == 2.0


def test_importing_aiodist_does_not_import_torch() -> None:
    # Why aiodist's errors do not derive from torch.distributed's classes (see aiodist.errors).
    code = "import sys, aiodist, aiodist.sync, aiodist.errors; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
