"""DDP step time: aiodist's DDP, torch's DDP on gloo and on "aiodist"; how much communication hides.

``python -m aiodist.parallel.bench_ddp [--world-size 2] [--layers 6] [--width 2048] [--json FILE]``

Three implementations, all by default (``--impl`` picks):

- ``aiodist``: ``aiodist.parallel.DistributedDataParallel`` on ``aiodist.sync``;
- ``torch``: torch's ``DistributedDataParallel`` on gloo;
- ``torch-aiodist``: torch's ``DistributedDataParallel`` on a group of the torch backend
  "aiodist" (``import aiodist.torch``; its C++ extension is built on first use).

Each rank runs them in one process on the same model (by default six 2048x2048
linear layers: 25.2M parameters, 100 MB of float32 gradients) and measures, as medians over the
timed steps (``--stat min``: minimum; ranks aligned by a barrier before each):

- ``step``: forward + backward through DDP, until every ``param.grad`` holds the average;
- ``compute``: the same forward + backward under ``no_sync()`` (no communication);
- ``comm``: all_reduce of the same gradient buckets, alone, after backward;
- ``exposed = step - compute``: the communication time backward did not hide;
- ``hidden = 1 - exposed / comm``: the share of communication overlapped with backward.

Needs torch. Not a test: numbers depend on the machine (cores shared by the ranks especially).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["main", "run"]


def _model(layers: int, width: int, seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    mods: list[Any] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods)


IMPLS = ("aiodist", "torch", "torch-aiodist")


class _Impl:
    """One implementation's DDP around its own copy of the model, and its three timed actions.

    ``group``: for "torch-aiodist", torch's process group on the backend "aiodist".
    """

    def __init__(self, impl: str, rank: int, cfg: dict[str, Any], group: Any = None) -> None:
        import functools

        import torch
        import torch.distributed as tdist

        import aiodist.sync as adist
        from aiodist.parallel import DistributedDataParallel, reverse_order_buckets

        self.model = _model(cfg["layers"], cfg["width"], seed=rank)
        self.x = torch.randn(cfg["batch"], cfg["width"], generator=torch.Generator().manual_seed(rank))
        if impl in ("torch", "torch-aiodist"):  # group None: torch's default group (gloo)
            self.ddp: Any = torch.nn.parallel.DistributedDataParallel(self.model, process_group=group)
            self.barrier: Any = functools.partial(tdist.barrier, group=group)
            self.all_reduce: Any = functools.partial(tdist.all_reduce, group=group)
        else:
            self.ddp = DistributedDataParallel(self.model)
            self.barrier = adist.barrier
            self.all_reduce = adist.all_reduce
        # "comm" reduces aiodist's buckets (1 MiB, then 25 MiB, in reverse order) for both.
        params = list(self.model.parameters())
        self.flats = [torch.zeros(sum(params[i].numel() for i in b)) for b in reverse_order_buckets(params)]

    def step(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self.ddp(self.x).pow(2).mean().backward()

    def compute(self) -> None:
        self.model.zero_grad(set_to_none=True)
        with self.ddp.no_sync():
            self.ddp(self.x).pow(2).mean().backward()

    def comm(self) -> None:
        works = [self.all_reduce(f, async_op=True) for f in self.flats]
        for w in works:
            w.wait()


def _measure(rank: int, cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Time each action of each implementation, interleaving the implementations step by step
    so that both see the same background load."""
    import torch.distributed as tdist

    group = None
    if "torch-aiodist" in cfg["impls"]:
        import aiodist.torch

        group = tdist.new_group(backend=aiodist.torch.BACKEND_NAME)
    impls = {name: _Impl(name, rank, cfg, group) for name in cfg["impls"]}
    out: dict[str, dict[str, Any]] = {name: {} for name in impls}
    for action in ("step", "compute", "comm"):
        times: dict[str, list[float]] = {name: [] for name in impls}
        for i in range(cfg["warmup"] + cfg["steps"]):
            for name, impl in impls.items():
                impl.barrier()
                start = time.perf_counter()
                getattr(impl, action)()
                if i >= cfg["warmup"]:
                    times[name].append(time.perf_counter() - start)
        for name in impls:
            pick = min if cfg.get("stat") == "min" else statistics.median
            out[name][action] = pick(times[name]) * 1000.0
        if action == "step" and "aiodist" in impls:
            # When, within its last backward, each bucket's all_reduce started (ms from the first hook).
            tl = impls["aiodist"].ddp.reducer.timeline
            t0 = tl["first_hook"]
            out["aiodist"]["bucket_starts"] = [round((t - t0) * 1000.0, 1) for t in tl["bucket_starts"]]
            out["aiodist"]["backward_end"] = round((tl["backward_end"] - t0) * 1000.0, 1)
            out["aiodist"]["grads_ready"] = round((tl["grads_ready"] - t0) * 1000.0, 1)
    return out


def _job(rank: int, world_size: int, torch_port: int, cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    import torch
    import torch.distributed as tdist

    import aiodist.sync as adist

    torch.set_num_threads(cfg["threads"])
    tdist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank, world_size=world_size
    )
    adist.init_process_group("tcp", timeout=datetime.timedelta(seconds=300))
    try:
        return _measure(rank, cfg)
    finally:
        adist.destroy_process_group()
        tdist.destroy_process_group()


def run(
    world_size: int = 2,
    layers: int = 6,
    width: int = 2048,
    batch: int = 32,
    warmup: int = 2,
    steps: int = 8,
    threads: int | None = None,
    impls: Sequence[str] = IMPLS,
    timeout: float = 900.0,
    stat: str = "median",
) -> dict[str, Any]:
    """Run the benchmark in ``world_size`` local processes; returns rank 0's figures and the setup."""
    from aiodist.testing import free_port, spawn

    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    cfg = {
        "layers": layers,
        "width": width,
        "batch": batch,
        "warmup": warmup,
        "steps": steps,
        "threads": threads,
        "impls": list(impls),
        "stat": stat,
    }
    results = spawn(
        _job, world_size, args=(free_port(), cfg), timeout=timeout, env={"OMP_NUM_THREADS": str(threads)}
    )
    n_params = layers * (width * width + width)
    figures = {}
    for impl in impls:
        # A step is as slow as its slowest rank.
        row: dict[str, Any] = {k: max(r[impl][k] for r in results) for k in ("step", "compute", "comm")}
        for k in ("bucket_starts", "backward_end", "grads_ready"):
            if k in results[0][impl]:
                row[k] = results[0][impl][k]
        row["exposed"] = max(0.0, row["step"] - row["compute"])
        row["hidden"] = min(1.0, max(0.0, 1.0 - row["exposed"] / row["comm"])) if row["comm"] > 0 else 0.0
        figures[impl] = row
    return {"config": {**cfg, "world_size": world_size, "params": n_params}, "results": figures}


def format_table(report: dict[str, Any]) -> str:
    cfg, res = report["config"], report["results"]
    lines = [
        f"DDP step: {cfg['params'] / 1e6:.1f}M float32 parameters ({cfg['params'] * 4 / 2**20:.0f} MiB of "
        f"gradients), {cfg['world_size']} ranks, batch {cfg['batch']}, {cfg['threads']} torch thread(s) per rank, "
        f"{cfg['stat']} of {cfg['steps']} steps",
        f"{'impl':<15}{'step ms':>10}{'compute ms':>12}{'comm ms':>10}{'exposed ms':>12}{'hidden':>9}",
    ]
    for impl, row in res.items():
        lines.append(
            f"{impl:<15}{row['step']:>10.1f}{row['compute']:>12.1f}{row['comm']:>10.1f}"
            f"{row['exposed']:>12.1f}{row['hidden'] * 100:>8.0f}%"
        )
    if "bucket_starts" in res.get("aiodist", {}):
        row = res["aiodist"]
        starts = ", ".join(f"{t:g}" for t in row["bucket_starts"])
        lines.append(
            f"aiodist, rank 0, last step: bucket all_reduces started at {starts} ms after the first "
            f"gradient hook; backward ended at {row['backward_end']:g} ms, averaged grads ready at "
            f"{row['grads_ready']:g} ms"
        )
    for impl in ("aiodist", "torch-aiodist"):
        if "torch" in res and impl in res:
            lines.append(f"step time {impl} / torch: {res[impl]['step'] / res['torch']['step']:.2f}x")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m aiodist.parallel.bench_ddp", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--world-size", "--nproc", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads per rank (default: cores / ranks)"
    )
    parser.add_argument(
        "--impl",
        dest="impls",
        action="append",
        choices=IMPLS,
        help="aiodist (aiodist.parallel), torch (torch's DDP on gloo), torch-aiodist (torch's DDP on "
        'the backend "aiodist"); repeat for several (default: all three)',
    )
    parser.add_argument(
        "--stat", choices=["median", "min"], default="median", help="min is steadier on a loaded machine"
    )
    parser.add_argument("--json", metavar="FILE", help="also save the figures as JSON")
    args = parser.parse_args(argv)
    impls = tuple(i for i in IMPLS if i in (args.impls or IMPLS))
    report = run(
        args.world_size,
        args.layers,
        args.width,
        args.batch,
        args.warmup,
        args.steps,
        args.threads,
        impls,
        stat=args.stat,
    )
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
