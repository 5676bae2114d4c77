"""`make demo`: launch local ranks running each example and show what they did."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PY = sys.executable

# (title, command). Scripts that start their own processes run directly; the rest run
# under the launcher, as a user would run them.
DEMOS: list[tuple[str, list[str]]] = [
    (
        "tutorial: blocking point-to-point, 4 ranks, rank 0 -> rank 3 (sync face, torch tensors)",
        [PY, str(HERE / "p2p_blocking.py")],
    ),
    ("tutorial: non-blocking point-to-point (isend/irecv + wait)", [PY, str(HERE / "p2p_nonblocking.py")]),
    (
        "tutorial: all_reduce in a group of ranks 0 and 1 (ranks 2, 3 are not members)",
        [PY, str(HERE / "allreduce_group.py")],
    ),
    ("tutorial: a hand-written ring all-reduce with isend/recv", [PY, str(HERE / "ring_allreduce.py")]),
    (
        "tutorial: distributed synchronous SGD, gradients averaged with all_reduce (partitioned synthetic data)",
        [PY, str(HERE / "sgd_allreduce.py")],
    ),
    ("tutorial: every collective of the tutorial's table, 4 ranks", [PY, str(HERE / "collectives_tour.py")]),
    (
        "init_process_group by hand: rank 0 with rank=/world_size=, rank 1 from RANK/WORLD_SIZE",
        [PY, str(HERE / "init_by_hand.py")],
    ),
    (
        "init_process_group(rank=0, world_size=1) wins over WORLD_SIZE=2: one-process training",
        [PY, str(HERE / "single_process_train.py")],
    ),
    (
        "legacy launcher passing --local_rank (python -m aiodist.launch)",
        [
            PY,
            "-m",
            "aiodist.launch",
            "--standalone",
            "--nproc_per_node=2",
            str(HERE / "launch_local_rank.py"),
        ],
    ),
    (
        "LOCAL_RANK from the environment (aiodist-run)",
        [PY, "-m", "aiodist.run", "--standalone", "--nproc-per-node", "2", str(HERE / "launch_env.py")],
    ),
    (
        "async pipeline: 4 stages, 16 micro-batches in flight (async face, via aiodist-run)",
        [PY, "-m", "aiodist.run", "--nproc-per-node", "4", str(HERE / "async_pipeline.py")],
    ),
    (
        "asyncio.gather over dozens of collectives of different ops and sizes (async face)",
        [PY, "-m", "aiodist.run", "--nproc-per-node", "4", str(HERE / "gather_many.py")],
    ),
    (
        "DistributedDataParallel: a small model trained on 3 ranks, gradients bucketed during backward",
        [PY, "-m", "aiodist.run", "--nproc-per-node", "3", str(HERE / "ddp_train.py")],
    ),
    (
        "unchanged PyTorch (torch's DDP + DistributedSampler) on backend 'aiodist', 2 ranks",
        [PY, "-m", "aiodist.run", "--nproc-per-node", "2", str(HERE / "torch_ddp_aiodist.py")],
    ),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    failures = 0
    for title, cmd in DEMOS:
        print(
            f"\n=== {title}\n$ {' '.join(Path(c).name if c.endswith('.py') else c for c in cmd[1:])}",
            flush=True,
        )
        # print(..., flush=True) then reaches the pipe in one write, so ranks do not interleave mid-line.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
        env["MASTER_PORT"] = str(free_port())
        start = time.monotonic()
        proc = subprocess.run(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120
        )
        for line in proc.stdout.splitlines():
            print("   ", line)
        status = "ok" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
        print(f"--- {status} in {time.monotonic() - start:.1f} s", flush=True)
        failures += proc.returncode != 0
    print(f"\n{len(DEMOS) - failures} of {len(DEMOS)} demos ran correctly.")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
