"""What the torch backend costs: ``python -m aiodist.torch.bench [--calls N] [--steps N]``.

Two ranks on loopback. Prints the time to load the C++ extension (from the cache), the median
latency of a small ``all_reduce`` three ways (torch's frontend on "aiodist", torch's frontend
on gloo, ``aiodist.sync`` directly), and the median step time of a small MLP trained with
torch's ``DistributedDataParallel`` on "aiodist" and on gloo, and with ``aiodist.parallel``'s.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from collections.abc import Callable
from typing import Any

from aiodist.testing import free_port, spawn

__all__ = ["main"]


def _interleaved_us(ways: dict[str, Callable[[], Any]], calls: int, rounds: int = 10) -> dict[str, float]:
    """Median latency of each way, in rounds that alternate the ways (so load drifts alike)."""
    per = max(1, calls // rounds)
    samples: dict[str, list[float]] = {name: [] for name in ways}
    for fn in ways.values():  # warm up
        for _ in range(per):
            fn()
    for _ in range(rounds):
        for name, fn in ways.items():
            for _ in range(per):
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) * 1e6 for name, v in samples.items()}


def _ddp_step_ms(ddp: Any, model: Any, steps: int, sync: Callable[[], Any]) -> float:
    import torch

    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = torch.randn(32, 256), torch.randn(32, 10)
    times = []
    for i in range(steps + 5):
        sync()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss: Any = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        if i >= 5:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _mlp() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )


def _rank(rank: int, world_size: int, aiodist_port: int, calls: int, steps: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    import aiodist.parallel
    import aiodist.sync as adist
    import aiodist.torch
    from aiodist.torch._build import load_extension

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    load_extension()
    out = {"load_extension_s": time.perf_counter() - t0}
    dist.init_process_group("aiodist", timeout=datetime.timedelta(seconds=120))
    gloo = dist.new_group(backend="gloo")
    adist.init_process_group(
        "tcp",
        f"tcp://127.0.0.1:{aiodist_port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    t = torch.ones(1)
    ways = {
        "all_reduce_torch_aiodist_us": lambda: dist.all_reduce(t),
        "all_reduce_torch_gloo_us": lambda: dist.all_reduce(t, group=gloo),
        "all_reduce_aiodist_sync_us": lambda: adist.all_reduce(t),
    }
    out.update(_interleaved_us(ways, calls))

    model = _mlp()
    out["ddp_torch_aiodist_ms"] = _ddp_step_ms(
        torch.nn.parallel.DistributedDataParallel(model), model, steps, lambda: dist.barrier()
    )
    model = _mlp()
    out["ddp_torch_gloo_ms"] = _ddp_step_ms(
        torch.nn.parallel.DistributedDataParallel(model, process_group=gloo),
        model,
        steps,
        lambda: dist.barrier(group=gloo),
    )
    model = _mlp()
    out["ddp_aiodist_parallel_ms"] = _ddp_step_ms(
        aiodist.parallel.DistributedDataParallel(model), model, steps, lambda: adist.barrier()
    )
    assert aiodist.torch.BACKEND_NAME == "aiodist"
    adist.destroy_process_group()
    dist.destroy_process_group()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--calls", type=int, default=500, help="all_reduce calls per way (median taken)")
    p.add_argument("--steps", type=int, default=50, help="DDP steps per way (median taken)")
    args = p.parse_args(argv)
    res = spawn(
        _rank, 2, args=(free_port(), args.calls, args.steps), timeout=900, env={"OMP_NUM_THREADS": "1"}
    )
    print(f"2 ranks on loopback; medians of {args.calls} calls / {args.steps} steps (rank 0 | rank 1)")
    for key in res[0]:
        unit = key.rsplit("_", 1)[1]
        print(f"  {key:32s} {res[0][key]:10.2f} | {res[1][key]:10.2f} {unit}")


if __name__ == "__main__":
    main()
