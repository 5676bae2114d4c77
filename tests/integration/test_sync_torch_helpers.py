"""torch's helpers under the sync face: they ask torch.distributed, which sees the sync face's job.

``aiodist.sync.init_process_group`` in a program that imported torch also initialises
torch.distributed's default group, on the "aiodist" backend over the same connections; its
destroy destroys it. ``AIODIST_TORCH_DEFAULT_GROUP`` (auto, 1, 0) decides. Real processes on
127.0.0.1 (``aiodist.testing.spawn``), each bounded by its timeout; torch is imported inside the
rank functions only, so that a rank of a numpy-only program starts without it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest

import aiodist.sync
from aiodist.testing import spawn

# Not importorskip: spawned ranks import this module, and a numpy-only rank must start without torch.
pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch"),
]


def _helpers(rank: int, size: int, ckpt: str) -> dict[str, Any]:
    import torch
    import torch.distributed as td
    import torch.distributed.checkpoint as dcp
    from torch.utils.data import DistributedSampler

    import aiodist.sync as dist

    dist.init_process_group("gloo")
    out: dict[str, Any] = {"torch sees": [td.is_initialized(), td.get_rank(), td.get_world_size()]}
    out["backend"] = str(td.get_backend())
    data = list(range(11))
    out["sampler"] = list(DistributedSampler(data, seed=3))
    out["sampler, told"] = list(DistributedSampler(data, num_replicas=size, rank=rank, seed=3))

    # Collectives through torch.distributed between the sync face's own, each in its turn.
    a = torch.full((3,), float(rank + 1))
    dist.all_reduce(a)
    b = torch.full((3,), float(rank + 1))
    td.all_reduce(b)
    gathered: list[Any] = [None] * size
    td.all_gather_object(gathered, {"rank": rank})
    c = torch.full((2,), float(rank))
    dist.broadcast(c, src=size - 1)
    out["sums"] = [a.tolist(), b.tolist(), c.tolist()]
    out["objects"] = gathered

    # torch's DistributedDataParallel: gradients averaged over the ranks.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp(torch.full((3, 4), float(rank + 1))).sum().backward()
    out["ddp grad"] = model.weight.grad.tolist()

    # torch.distributed.checkpoint: saved by every rank, loaded back.
    torch.manual_seed(1)
    saved = torch.nn.Linear(3, 2)
    dcp.save({"model": saved.state_dict()}, checkpoint_id=ckpt)
    loaded = torch.nn.Linear(3, 2)
    with torch.no_grad():
        loaded.weight.zero_()
        loaded.bias.zero_()
    state = {"model": loaded.state_dict()}
    dcp.load(state, checkpoint_id=ckpt)
    out["checkpoint"] = torch.equal(state["model"]["weight"], saved.weight.detach())

    # Groups torch makes: on aiodist over the same connections, and a gloo one (torch's store).
    sub = td.new_group(list(range(size)))
    gloo = td.new_group(list(range(size)), backend="gloo")
    d = torch.ones(1) * (rank + 1)
    td.all_reduce(d, group=sub)
    td.all_reduce(d, group=gloo)
    out["subgroups"] = [str(td.get_backend(sub)), str(td.get_backend(gloo)), d.item()]

    dist.destroy_process_group()
    out["after destroy"] = td.is_initialized()
    dist.init_process_group("gloo")  # again, at the same address: torch's default group again
    e = torch.ones(1)
    td.all_reduce(e)
    out["again"] = [td.get_world_size(), e.item()]
    dist.destroy_process_group()
    return out


def test_torchs_helpers_see_the_sync_job(tmp_path: Path) -> None:
    size = 2
    results = spawn(_helpers, size, args=(str(tmp_path / "ckpt"),), timeout=110)
    total = float(sum(range(1, size + 1)))
    for rank, out in enumerate(results):
        assert out["torch sees"] == [True, rank, size]
        assert out["backend"] == "aiodist"
        assert out["sampler"] == out["sampler, told"]
        assert out["sums"] == [[total] * 3, [total] * 3, [float(size - 1)] * 2]
        assert out["objects"] == [{"rank": r} for r in range(size)]
        # d(sum(W x))/dW = sum over the batch of x: 3 (rank + 1) in every entry, averaged.
        assert out["ddp grad"] == [[3.0 * total / size] * 4] * 2
        assert out["checkpoint"] is True
        assert out["subgroups"] == ["aiodist", "gloo", total * size]
        assert out["after destroy"] is False
        assert out["again"] == [size, float(size)]


def _sync_batch_norm(rank: int, size: int) -> dict[str, Any]:
    import torch

    import aiodist.sync as dist

    dist.init_process_group("gloo")
    bn = torch.nn.SyncBatchNorm(3)
    x = torch.randn(4, 3)
    out: dict[str, Any] = {}
    try:
        bn(x)  # training: its statistics would be all-gathered through torch.distributed
    except ValueError as exc:
        out["training"] = str(exc)
    bn.eval()
    out["eval"] = list(bn(x).shape)  # the running statistics: nothing to gather
    dist.destroy_process_group()
    return out


def test_sync_batch_norm_refuses_cpu_tensors_as_under_gloo() -> None:
    """SyncBatchNorm gathers statistics only for GPU tensors: on CPU torch refuses, as with gloo
    (without the default group it would silently not synchronise)."""
    for out in spawn(_sync_batch_norm, 2, timeout=90):
        assert "SyncBatchNorm expected input tensor to be on GPU" in out["training"]
        assert out["eval"] == [4, 3]


def _numpy_only(rank: int, size: int) -> dict[str, Any]:
    import numpy as np

    import aiodist.sync as dist

    dist.init_process_group("gloo")
    x = np.full(2, rank + 1.0)
    dist.all_reduce(x)
    out = {"sum": x.tolist(), "torch imported": "torch" in sys.modules}
    dist.destroy_process_group()
    return out


def test_a_numpy_program_does_not_import_torch() -> None:
    for out in spawn(_numpy_only, 2, timeout=60):
        assert out == {"sum": [3.0, 3.0], "torch imported": False}


def _torch_told(rank: int, size: int, given: str | None = None) -> dict[str, Any]:
    import aiodist.sync as dist

    dist.init_process_group("gloo", torch_default_group=given)  # (the variable is 1 or 0 here)
    import torch.distributed as td

    out: dict[str, Any] = {"initialised": td.is_initialized()}
    try:
        out["world"] = td.get_world_size()
    except ValueError as exc:  # torch's own error, as a helper meets it
        out["world"] = str(exc)
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize(
    ("mode", "given"), [("1", None), ("0", None), ("0", "0")], ids=["1", "0", "argument"]
)
def test_the_variable_decides(mode: str, given: str | None) -> None:
    """AIODIST_TORCH_DEFAULT_GROUP, or init_process_group's torch_default_group over it (a
    program that makes torch's default group itself, as aiodist-bench does for gloo)."""
    env = {"AIODIST_TORCH_DEFAULT_GROUP": "1" if given is not None else mode}
    results = spawn(_torch_told, 2, args=(given,), timeout=60, env=env)
    for out in results:
        if mode == "1":  # even though the program had not imported torch
            assert out == {"initialised": True, "world": 2}
        else:
            assert out["initialised"] is False
            assert "Default process group has not been initialized" in out["world"]


def _torch_first(rank: int, size: int, port: int) -> dict[str, Any]:
    import datetime

    import torch
    import torch.distributed as td

    import aiodist.sync as dist

    td.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=60),
    )
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    td.all_reduce(t)
    out = {"backend": str(td.get_backend()), "sum": t.item()}
    dist.destroy_process_group()
    out["torch kept"] = td.is_initialized()
    td.destroy_process_group()
    return out


def test_a_program_that_initialised_torch_itself_keeps_its_group() -> None:
    from aiodist.testing import free_port

    for out in spawn(_torch_first, 2, args=(free_port(),), timeout=90):
        assert out == {"backend": "gloo", "sum": 4.0, "torch kept": True}


def _peer_dies(rank: int, size: int) -> str:
    import torch
    import torch.distributed as td

    import aiodist.sync as dist

    dist.init_process_group("gloo", timeout=30)
    dist.barrier()
    if rank == 1:
        os._exit(7)
    try:
        td.all_reduce(torch.ones(4))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_lost_peer_is_named_through_torch() -> None:
    out = spawn(_peer_dies, 2, timeout=60, expect_failure=[1])[0]
    assert "DistNetworkError" in out and "rank 1" in out, out


def test_a_bad_value_fails_before_the_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIODIST_TORCH_DEFAULT_GROUP", "yes")
    with pytest.raises(ValueError, match="AIODIST_TORCH_DEFAULT_GROUP='yes': use auto, 1 or 0"):
        aiodist.sync.init_process_group("gloo", store=aiodist.sync.HashStore(), rank=0, world_size=1)
    with pytest.raises(ValueError, match="torch_default_group='no': use auto, 1 or 0"):
        aiodist.sync.init_process_group(
            "gloo", store=aiodist.sync.HashStore(), rank=0, world_size=1, torch_default_group="no"
        )
    assert not aiodist.sync.is_initialized()


def test_asked_for_while_torch_has_a_default_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """``1`` and a default group of the program's own: refused, and the sync face's init undone."""
    import torch.distributed as td

    td.init_process_group("gloo", store=td.HashStore(), rank=0, world_size=1)
    try:
        monkeypatch.setenv("AIODIST_TORCH_DEFAULT_GROUP", "1")
        with pytest.raises(ValueError, match=r"torch\.distributed's default group exists already"):
            aiodist.sync.init_process_group("gloo", store=aiodist.sync.HashStore(), rank=0, world_size=1)
        assert not aiodist.sync.is_initialized()
        assert str(td.get_backend()) == "gloo"
    finally:
        td.destroy_process_group()


def _torch_subgroup(rank: int, size: int) -> dict[str, Any]:
    import torch
    import torch.distributed as tdist

    import aiodist.sync as dist

    dist.init_process_group("gloo", timeout=30)
    pg = tdist.new_group(list(range(size)))  # torch's helper: a group on the "aiodist" backend
    out: list[Any] = [None] * size
    dist.all_gather_object(out, {"rank": rank}, group=pg)
    t = torch.ones(3)
    dist.all_reduce(t, group=pg)
    got = {"objects": out, "sum": t.tolist(), "rank": dist.get_rank(pg), "size": dist.get_world_size(pg)}
    dist.destroy_process_group()
    return got


def test_a_group_made_by_torchs_new_group_works_in_the_sync_face() -> None:
    """torch's own suite, through aiodist.sync, hands aiodist.sync the groups torch.distributed
    made (test_all_gather_object_subgroup): they are aiodist's groups underneath."""
    for rank, got in enumerate(spawn(_torch_subgroup, 2, timeout=90)):
        assert got == {"objects": [{"rank": 0}, {"rank": 1}], "sum": [2.0] * 3, "rank": rank, "size": 2}, got
