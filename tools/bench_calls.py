"""How many function calls one small operation costs each rank: 2 ranks on this host, async face.

Usage: python tools/bench_calls.py [--ops pingpong,all_reduce,barrier,broadcast] [-n 2000] [--json FILE]

Timings of small operations swing by 2x from run to run on a shared machine; the number of calls
on an operation's path does not, and on the Python engine it is most of what an operation costs.
Each rank runs the operations under cProfile after a warm-up and reports the calls per operation:
all of them, and those of Python functions. Busy polling is off (``AIODIST_BUSY_POLL_US=0``), so
the poller's idle turns, whose number depends on timing, are not counted; the doorbells that
replace them are. ``pingpong`` counts one message each way: a send and a receive per rank.
To compare with another checkout, run it with that checkout first on ``PYTHONPATH``.
(Repository tooling, as ``bench_init.py``.)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

OPS = ("pingpong", "all_reduce", "barrier", "broadcast")

# One rank: join, warm up, profile n operations, report calls per operation.
_RANK = r"""
import asyncio, cProfile, json, pstats, sys
import numpy as np
import uvloop
import aiodist as dist

ops, n, out = sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3]

async def main():
    await dist.init_process_group("tcp", "env://", timeout=60)
    rank = dist.get_rank()
    t = np.ones(1, np.float32)
    b = np.zeros(2, np.float32)

    async def one(op):
        if op == "all_reduce":
            await dist.all_reduce(t)
        elif op == "barrier":
            await dist.barrier()
        elif op == "broadcast":
            await dist.broadcast(t, 0)
        elif rank == 0:
            await dist.send(b, 1)
            await dist.recv(b, 1)
        else:
            await dist.recv(b, 0)
            await dist.send(b, 0)

    report = {}
    for op in ops:
        for _ in range(200):
            await one(op)
        await dist.barrier()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            await one(op)
        prof.disable()
        await dist.barrier()
        stats = pstats.Stats(prof)
        python = sum(v[1] for k, v in stats.stats.items() if not k[0].startswith("~"))
        report[op] = [stats.total_calls / n, python / n]
    await dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"rank": rank, "calls": report}, f)

uvloop.run(main())
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(ops: list[str], n: int, timeout: float = 300.0) -> list[dict[str, object]]:
    """One row per operation: calls per operation on rank 0 and rank 1 (all, and Python's)."""
    with tempfile.TemporaryDirectory(prefix="aiodist-bench-calls-") as d:
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            AIODIST_BUSY_POLL_US="0",
        )
        outs = [os.path.join(d, f"rank{r}.json") for r in range(2)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _RANK, ",".join(ops), str(n), outs[r]],
                env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                cwd=d,  # (not the caller's directory: PYTHONPATH chooses the checkout)
            )
            for r in range(2)
        ]
        for p in procs:
            if p.wait(timeout) != 0:
                raise SystemExit(f"bench_calls: a rank exited with {p.returncode}")
        reports = [json.loads(Path(o).read_text())["calls"] for o in outs]
    return [
        {
            "op": op,
            "calls": [round(reports[r][op][0], 1) for r in range(2)],
            "python_calls": [round(reports[r][op][1], 1) for r in range(2)],
        }
        for op in ops
    ]


def markdown(rows: list[dict[str, object]]) -> str:
    lines = [
        "| operation | calls, rank 0 | calls, rank 1 | Python functions, rank 0 | Python functions, rank 1 |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        calls, python = row["calls"], row["python_calls"]
        assert isinstance(calls, list) and isinstance(python, list)
        lines.append(f"| {row['op']} | {calls[0]} | {calls[1]} | {python[0]} | {python[1]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma separated, of {', '.join(OPS)}")
    parser.add_argument("-n", type=int, default=2000, help="operations profiled per op (default 2000)")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    args = parser.parse_args()
    ops = args.ops.split(",")
    unknown = [op for op in ops if op not in OPS]
    if unknown or args.n < 1:
        parser.error(f"unknown operations {unknown}" if unknown else "-n must be at least 1")
    rows = run(ops, args.n)
    print(markdown(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
