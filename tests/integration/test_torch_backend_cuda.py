"""CUDA tensors on the torch backend "aiodist": staged through pinned host memory. GPU machines
only (``make test-gpu``); everything here skips, saying why, where CUDA is missing. What does not
need a GPU (the registration, the routing of every operation and of torch's DDP through the
staging path, with host buffers standing in for pinned ones) is covered on CPU by
tests/unit/test_torch_registration.py and tests/integration/test_torch_backend.py."""

from __future__ import annotations

import datetime
import os
import shutil
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from aiodist.testing import spawn  # noqa: E402

HAVE_CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if HAVE_CUDA else 0
HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None or shutil.which("g++") is not None

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not HAVE_CUDA, reason=f"no CUDA device (torch {torch.__version__}): GPU-only tests"),
]
LEVELS = [
    pytest.param(
        "cpp",
        marks=pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: the extension cannot be built"),
    ),
    "python",
]
ENV = {"OMP_NUM_THREADS": "1"}


def _device(rank: int) -> Any:
    # one GPU per rank where there are enough; else the ranks share GPU 0 (staging needs no NCCL)
    return torch.device("cuda", rank % GPUS)


def _cuda_ops(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    import aiodist.torch  # noqa: F401
    from aiodist.backends.staged import CudaStager
    from aiodist.torch._backend import adapter_of

    dev = _device(rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("aiodist", timeout=datetime.timedelta(seconds=120))
    n, r = world_size, rank
    pg = dist.group.WORLD
    out: dict[str, Any] = {
        "capability": dist.Backend.backend_capability["aiodist"],
        "cuda_backend_is_cpu_backend": type(pg).__name__ == "PythonProcessGroup"
        or pg._get_backend(torch.device("cuda")) is pg._get_backend(torch.device("cpu")),
    }
    t = torch.arange(4, dtype=torch.float32, device=dev) + r
    dist.all_reduce(t)
    out["all_reduce"] = t.cpu().tolist()
    t = torch.full((3,), float(r), device=dev)
    dist.broadcast(t, src=1)
    out["broadcast"] = t.cpu().tolist()
    big = torch.zeros(2 * n, device=dev)
    dist.all_gather_into_tensor(big, torch.full((2,), float(r), device=dev))
    out["all_gather_into_tensor"] = big.cpu().tolist()
    o = torch.zeros(2, device=dev)
    dist.reduce_scatter_tensor(o, torch.arange(2 * n, dtype=torch.float32, device=dev) * (r + 1))
    out["reduce_scatter_tensor"] = o.cpu().tolist()
    buf = torch.zeros(2, device=dev)
    reqs = [
        dist.isend(torch.full((2,), float(r), device=dev), (r + 1) % n),
        dist.irecv(buf, (r - 1) % n),
    ]
    for q in reqs:
        q.wait()
    out["isend_irecv"] = buf.cpu().tolist()
    # the caller's current stream: a slow kernel, then the write the collective must see
    stream = torch.cuda.Stream(device=dev)
    x = torch.zeros(1000, device=dev)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)
        x.fill_(float(r + 1))
        work = dist.all_reduce(x, async_op=True)
    work.wait()
    out["callers_stream"] = sorted(set(x.cpu().tolist()))
    fut = dist.all_reduce(torch.ones(3, device=dev), async_op=True).get_future()
    out["future"] = fut.then(lambda f: f.value()[0].cpu() + 1).wait().tolist()
    adapter = adapter_of(str(pg.group_name))
    stager = adapter.group.stager if adapter is not None else None
    out["stager"] = type(stager).__name__
    out["pinned_pool_used"] = isinstance(stager, CudaStager) and stager.pool.misses > 0
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("level", LEVELS)
def test_cuda_tensors_are_staged_on_aiodist(level: str) -> None:
    n = 2
    res = spawn(_cuda_ops, n, timeout=280, env={**ENV, "AIODIST_TORCH_BACKEND": level})
    for r, out in enumerate(res):
        assert out["capability"] == ["cpu", "cuda"]
        assert out["cuda_backend_is_cpu_backend"] is True
        assert out["all_reduce"] == [sum(i + k for k in range(n)) for i in range(4)]
        assert out["broadcast"] == [1.0] * 3
        assert out["all_gather_into_tensor"] == [float(k) for k in range(n) for _ in range(2)]
        assert out["reduce_scatter_tensor"] == [float((2 * r + j) * 3) for j in range(2)]
        assert out["isend_irecv"] == [float((r - 1) % n)] * 2
        assert out["callers_stream"] == [float(n * (n + 1) // 2)]
        assert out["future"] == [float(n + 1)] * 3
        assert out["stager"] == "CudaStager" and out["pinned_pool_used"] is True


def _cuda_ddp(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    import aiodist.torch  # noqa: F401

    dev = _device(rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("aiodist", timeout=datetime.timedelta(seconds=120))
    gloo = dist.new_group(backend="gloo")  # gloo reduces CUDA tensors too: the reference
    histories = {}
    for name, group in (("aiodist", None), ("gloo", gloo)):
        torch.manual_seed(1000 + rank)
        model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3)).to(dev)
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[dev], process_group=group, bucket_cap_mb=0.002
        )
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(7919 * rank + 1)
        history = []
        for _ in range(4):
            x = torch.randn(8, 12, generator=gen).to(dev)
            opt.zero_grad()
            ddp(x).pow(2).sum().backward()
            opt.step()
            history.append([p.detach().cpu().numpy().copy() for p in model.parameters()])
        histories[name] = history
    dist.destroy_process_group()
    return histories


def test_torch_ddp_on_cuda_matches_gloo() -> None:
    res = spawn(_cuda_ddp, 2, timeout=280, env=ENV)
    for rank, out in enumerate(res):
        for step, (a_state, g_state) in enumerate(zip(out["aiodist"], out["gloo"], strict=True)):
            for k, (a, g) in enumerate(zip(a_state, g_state, strict=True)):
                np.testing.assert_array_equal(a, g, err_msg=f"rank {rank}, step {step}, param {k}")
