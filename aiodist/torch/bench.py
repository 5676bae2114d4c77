"""What the torch backend costs: ``python -m aiodist.torch.bench [--calls N] [--steps N]``.

Two ranks on loopback. Prints the time to load the C++ extension (from the cache), the median
latency of a small ``all_reduce`` three ways (torch's frontend on "aiodist", torch's frontend
on gloo, ``aiodist.sync`` directly), then the DDP step benchmark (``aiodist.parallel.bench_ddp``)
on a small MLP (three 512x512 layers, batch 32, one torch thread per rank): torch's
``DistributedDataParallel`` on "aiodist" and on gloo, and ``aiodist.parallel``'s.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from collections.abc import Callable
from typing import Any

from aiodist.parallel import bench_ddp
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


def _rank(rank: int, world_size: int, aiodist_port: int, calls: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

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

    assert aiodist.torch.BACKEND_NAME == "aiodist"
    adist.destroy_process_group()
    dist.destroy_process_group()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--calls", type=int, default=500, help="all_reduce calls per way (median taken)")
    p.add_argument("--steps", type=int, default=50, help="DDP steps per implementation (median taken)")
    args = p.parse_args(argv)
    res = spawn(_rank, 2, args=(free_port(), args.calls), timeout=900, env={"OMP_NUM_THREADS": "1"})
    print(f"2 ranks on loopback; medians of {args.calls} calls (rank 0 | rank 1)")
    for key in res[0]:
        unit = key.rsplit("_", 1)[1]
        print(f"  {key:32s} {res[0][key]:10.2f} | {res[1][key]:10.2f} {unit}")
    print(
        bench_ddp.format_table(
            bench_ddp.run(2, layers=3, width=512, batch=32, warmup=5, steps=args.steps, threads=1)
        )
    )


if __name__ == "__main__":
    main()
