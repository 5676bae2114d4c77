"""CUDA tensors: staged through pinned host memory on "tcp", native on "nccl". GPU machines only
(``make test-gpu``); everything here skips, saying why, where CUDA is missing. What does not
need a GPU is covered on CPU by tests/collectives/test_staging.py and tests/integration/test_engine.py."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from support.suite import async_suite, check_async_suite, check_sync_suite, sync_suite  # noqa: E402

import aiodist as dist  # noqa: E402
from aiodist.backends import staged as _staging  # noqa: E402
from aiodist.face import world as _world  # noqa: E402
from aiodist.store import HashStore  # noqa: E402
from aiodist.testing import spawn  # noqa: E402

HAVE_CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if HAVE_CUDA else 0

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not HAVE_CUDA, reason=f"no CUDA device (torch {torch.__version__}): GPU-only tests"),
]
two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"NCCL needs one GPU per rank: 2 wanted, {GPUS} found")
nccl = pytest.mark.skipif(
    not (HAVE_CUDA and torch.distributed.is_nccl_available()), reason="torch built without NCCL"
)


# -- the CUDA stager, in this process ------------------------------------------------------------


async def test_cuda_stager_round_trip_on_the_callers_stream() -> None:
    stager = _staging.CudaStager(max_cached_bytes=1 << 24)
    stream = torch.cuda.Stream()
    t = torch.zeros(1000, device="cuda")
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20_000_000)  # a slow kernel queued before the call...
        t.fill_(3.0)  # ...then the write the copy must see
        s = stager.stage(t, arg="tensor", copy_in=True, copy_out=True)
    assert s.host.is_pinned() and s.host.device.type == "cpu" and s.stream == stream
    await stager.ready([s])
    assert (s.host == 3.0).all()
    s.host.mul_(2)  # what an operation would write
    await stager.finish([s])
    assert (t.cpu() == 6.0).all()
    assert stager.pool.in_use_bytes == 0 and stager.pool.cached_bytes == 4096
    again = stager.stage(torch.ones(100, device="cuda"), arg="tensor", copy_in=True, copy_out=False)
    assert stager.pool.hits == 1  # the pinned buffer was reused
    stager.wait_ready([again])
    assert (again.host == 1).all()
    stager.discard([again])
    stager.close()
    assert stager.pool.cached_bytes == 0


async def test_device_rules_on_tcp() -> None:
    await dist.init_process_group("tcp", store=HashStore(), rank=0, world_size=1, device_id=0)
    try:
        t = torch.arange(4.0, device="cuda")
        await dist.all_reduce(t)  # staged: world size 1
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
        with pytest.raises(dist.DistValueError, match="one device"):
            dist.all_gather_into_tensor(torch.zeros(4, device="cuda"), torch.zeros(4))
        with pytest.raises(dist.DistValueError, match="contiguous"):
            dist.all_reduce(torch.zeros(3, 3, device="cuda").t())
        # the caller's current stream is respected
        stream = torch.cuda.Stream()
        x = torch.zeros(10, device="cuda")
        with torch.cuda.stream(stream):
            torch.cuda._sleep(20_000_000)
            x.fill_(5.0)
            work = dist.all_reduce(x)
        await work
        assert x.cpu().tolist() == [5.0] * 10
        stager = _world.world().staged.stager
        assert isinstance(stager, _staging.CudaStager)
    finally:
        await dist.destroy_process_group()
    assert stager.pool.closed and stager.pool.cached_bytes == 0


@nccl
async def test_device_rules_on_nccl() -> None:
    await dist.init_process_group("nccl", store=HashStore(), rank=0, world_size=1, device_id=0)
    try:
        t = torch.ones(4, device="cuda")
        await dist.all_reduce(t)
        assert t.tolist() == [1.0] * 4
        with pytest.raises(dist.DistValueError, match="'nccl' runs CUDA tensors only"):
            dist.all_reduce(torch.ones(4))
        with pytest.raises(dist.DistValueError, match="'nccl' runs CUDA tensors only"):
            dist.all_reduce(np.ones(4))
    finally:
        await dist.destroy_process_group()


# -- the suite over processes ----------------------------------------------------------------------


def test_staged_async_face_cuda_tensors() -> None:
    res = spawn(async_suite, 2, args=("tcp", ("cuda",)), timeout=110)
    check_async_suite(res, 2, ("cuda",))


def test_staged_sync_face_cuda_tensors() -> None:
    res = spawn(sync_suite, 2, args=("tcp", "cuda"), timeout=110)
    check_sync_suite(res, 2)


@nccl
@two_gpus
def test_nccl_async_face() -> None:
    res = spawn(async_suite, 2, args=("nccl", ("cuda",)), timeout=110)
    check_async_suite(res, 2, ("cuda",))
    assert all(out["backend"] == "nccl" for out in res)


@nccl
@two_gpus
def test_nccl_sync_face() -> None:
    res = spawn(sync_suite, 2, args=("nccl", "cuda"), timeout=110)
    check_sync_suite(res, 2)
