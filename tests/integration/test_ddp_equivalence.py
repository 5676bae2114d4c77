"""aiodist's DistributedDataParallel trains exactly like torch's (gloo), step by step.

Two real processes run the same training twice, once wrapped in ``torch.nn.parallel.
DistributedDataParallel`` over torch.distributed/gloo and once in aiodist's over aiodist.sync:
different initial weights and data per rank, several gradient buckets, momentum SGD,
BatchNorm buffers, a ``no_sync`` accumulation step, ``gradient_as_bucket_view``, a model with a
parameter no rank uses and one that only some ranks use per step (``find_unused_parameters``),
and the fp16 compression hook. Every parameter and buffer is recorded after every step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from aiodist.testing import free_port, spawn

torch = pytest.importorskip("torch")

STEPS = 5
NO_SYNC_STEP = 2
FLOAT32_TOL = dict(rtol=1e-5, atol=1e-6)


class _Net(torch.nn.Module):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(12, 32)
        self.bn1 = torch.nn.BatchNorm1d(32)
        self.fc2 = torch.nn.Linear(32, 32)
        self.bn2 = torch.nn.BatchNorm1d(32)
        self.head = torch.nn.Linear(32, 3)

    def forward(self, x: Any, use_aux: bool = True) -> Any:
        h = torch.relu(self.bn1(self.fc1(x)))
        h = torch.relu(self.bn2(self.fc2(h)))
        return self.head(h)


class _UnusedNet(torch.nn.Module):  # type: ignore[misc]
    """``never`` is used by no rank; ``aux`` only by some ranks at some steps."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(12, 32)
        self.bn1 = torch.nn.BatchNorm1d(32)
        self.aux = torch.nn.Linear(32, 32)
        self.never = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(32, 3)

    def forward(self, x: Any, use_aux: bool = True) -> Any:
        h = torch.relu(self.bn1(self.fc1(x)))
        if use_aux:
            h = h + torch.tanh(self.aux(h))
        return self.head(h)


# name -> (model class, DDP keyword arguments, communication hook name or None)
CONFIGS: dict[str, tuple[type, dict[str, Any], str | None]] = {
    "buckets+bn+no_sync": (_Net, {"bucket_cap_mb": 0.002}, None),
    "grad_as_bucket_view": (_Net, {"bucket_cap_mb": 0.002, "gradient_as_bucket_view": True}, None),
    "find_unused": (_UnusedNet, {"bucket_cap_mb": 0.002, "find_unused_parameters": True}, None),
    "fp16_hook": (_Net, {"bucket_cap_mb": 0.002}, "fp16"),
}


def _train(rank: int, impl: str, config: str) -> list[list[np.ndarray]]:
    model_cls, kwargs, hook = CONFIGS[config]
    torch.manual_seed(1000 + rank)  # different initial weights on each rank
    model = model_cls()
    if impl == "torch":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp = torch.nn.parallel.DistributedDataParallel(model, **kwargs)
        if hook == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    else:
        from aiodist.parallel import DistributedDataParallel, hooks

        ddp = DistributedDataParallel(model, **kwargs)
        if hook == "fp16":
            ddp.register_comm_hook(None, hooks.fp16_compress_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(7919 * rank + 1)  # different data on each rank
    history = []
    for step in range(STEPS):
        x = torch.randn(8, 12, generator=gen)
        y = torch.randint(0, 3, (8,), generator=gen)
        use_aux = (step + rank) % 2 == 0
        opt.zero_grad()
        if step == NO_SYNC_STEP:
            with ddp.no_sync():  # accumulate one micro-batch locally...
                loss_fn(ddp(x[:4], use_aux), y[:4]).backward()
            loss_fn(ddp(x[4:], use_aux), y[4:]).backward()  # ...and average both with the next
        else:
            loss_fn(ddp(x, use_aux), y).backward()
        opt.step()
        state = [p.detach().numpy().copy() for p in model.parameters()]
        state += [b.detach().numpy().copy() for b in model.buffers()]
        state.append(np.array([p.grad is None for p in model.parameters()]))  # untouched grads stay None
        history.append(state)
    return history


def _both(rank: int, world_size: int, torch_port: int) -> dict[str, dict[str, Any]]:
    import torch.distributed as tdist

    import aiodist.sync as adist

    torch.set_num_threads(1)
    tdist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank, world_size=world_size
    )
    adist.init_process_group("tcp", timeout=30)
    try:
        return {
            config: {impl: _train(rank, impl, config) for impl in ("torch", "aiodist")} for config in CONFIGS
        }
    finally:
        adist.destroy_process_group()
        tdist.destroy_process_group()


@pytest.mark.timeout(120)
def test_ddp_matches_torch_ddp_step_by_step() -> None:
    results = spawn(_both, 2, args=(free_port(),), timeout=110, env={"OMP_NUM_THREADS": "1"})
    worst = 0.0
    for config in CONFIGS:
        for rank, per_rank in enumerate(results):
            ours, theirs = per_rank[config]["aiodist"], per_rank[config]["torch"]
            for step, (a_state, t_state) in enumerate(zip(ours, theirs, strict=True)):
                for k, (a, t) in enumerate(zip(a_state, t_state, strict=True)):
                    worst = max(worst, float(np.max(np.abs(a.astype(np.float64) - t))) if a.size else 0.0)
                    np.testing.assert_allclose(
                        a, t, **FLOAT32_TOL, err_msg=f"{config}: rank {rank}, step {step}, tensor {k}"
                    )
        # Both ranks hold the same parameters after every step (buffers are local statistics).
        n_params = sum(1 for _ in CONFIGS[config][0]().parameters())
        for step in range(STEPS):
            for k in range(n_params):
                np.testing.assert_array_equal(
                    results[0][config]["aiodist"][step][k], results[1][config]["aiodist"][step][k]
                )
    print(f"max |aiodist - torch| over all configs, ranks, steps and tensors: {worst:.3g}")
