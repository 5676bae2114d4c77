"""Staging through host buffers, on CPU, with ranks as tasks over the memory transport: the call
order when only some ranks stage, a failed staged operation, the CUDA path taken by tensors the
tensor layer refuses, and the job's stager freed by destroy. The pool itself is
tests/unit/test_staging_pool.py; every operation staged (``HostStager``, the CPU twin of
``CudaStager``), over memory and TCP in both faces, is tests/integration/test_every_operation.py.
Only the device hop itself (streams, events, pinned memory) is left to
tests/integration/test_cuda.py."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from support.worlds import staged_world

import aiodist as dist
from aiodist import _tensors
from aiodist.backends import staged as _staging
from aiodist.backends.staged import HostStager
from aiodist.face import world as _world
from aiodist.group import ProcessGroup
from aiodist.store import HashStore

pytestmark = pytest.mark.timeout(90)

try:
    import torch
except ImportError:  # pragma: no cover - torch is optional
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")


async def test_staging_keeps_the_call_order_when_only_some_ranks_stage() -> None:
    # Rank 0 stages, rank 1 does not: the staged call still takes its sequence number at the
    # call, so back-to-back collectives match across ranks.
    fabric, groups = staged_world([HostStager(), None])
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
    stager = HostStager()
    fabric, groups = staged_world([stager, None])
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
async def test_device_tensors_are_staged_by_the_staged_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    # "Device" tensors are CPU tensors marked here; the tensor layer refuses them as it refuses
    # CUDA tensors (DeviceTensorError), so only their twins can reach it, as on a GPU.
    marked: set[int] = set()
    monkeypatch.setattr(_tensors, "_is_cuda", lambda obj: id(obj) in marked)

    class DeviceStager(HostStager):
        def wants(self, obj: object) -> bool:
            return id(obj) in marked

        def stage(self, obj: Any, **kw: Any) -> _staging.Staged:
            marked.discard(id(obj))  # copy it as the host tensor it really is
            try:
                return super().stage(obj, **kw)
            finally:
                marked.add(id(obj))

    stagers = [DeviceStager() for _ in range(2)]
    fabric, groups = staged_world(stagers)
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
        bare = ProcessGroup(fabric.transports[1], range(2), 1, timeout=30)  # on the native backend
        with pytest.raises(dist.DistValueError, match=r"is a CUDA tensor .*staging"):
            dist.all_reduce(dev, group=bare)
    finally:
        for tr in fabric.transports:
            tr.abort()


# -- the job's stager: installed on every group, freed by destroy_process_group ------------------------------


@pytest.mark.integration  # a real (one-rank) TCP job: not in the fast tier
async def test_pool_released_on_destroy() -> None:
    await dist.init_process_group("tcp", store=HashStore(), rank=0, world_size=1)
    try:
        default = _world.world().staged.stager
        assert (
            isinstance(default, _staging.CudaStager) and default.pool.cached_bytes == 0
        )  # nothing allocated
        stager = HostStager()
        assert _world.set_stager(stager) is default
        sub = await dist.new_group([0])
        assert sub.runs_on is _world.world().staged and _world.world().staged.stager is stager
        t = np.arange(10.0)
        await dist.all_reduce(t)
        await dist.broadcast(t, 0, group=sub)
        assert stager.pool.cached_bytes > 0 and stager.copies_out == 2
    finally:
        await dist.destroy_process_group()
    assert stager.pool.closed and stager.pool.cached_bytes == 0
