"""How long N ranks on this host take to join a job: aiodist beside torch's gloo, alternating.

Usage: python tools/bench_init.py [-np 16,32,64] [-r 2] [--peers aiodist,gloo] [--hosts H] [--json FILE]

Every rank is a process of its own that imports its library first; the clock starts when all
of them have, so imports are not counted. Measured: the time from that start until the last
rank's ``init_process_group`` returned, and until the last rank's first barrier returned. The
runs of the peers alternate, so that a machine's drift does not favour one of them.
``--hosts H`` places aiodist's ranks on H "hosts" of this machine (``AIODIST_HOST_ID``, ranks in
blocks): ranks of one host connect at init, the others on first use (gloo knows no hosts).
(Repository tooling, as ``bench_targets.py``: it reads launcher variables of its own.)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# One rank: import, say so, wait for the start, join, barrier, leave; report its clock.
_RANK = r"""
import datetime, json, os, sys, time
peer, start_file, out = sys.argv[1:4]
if peer == "gloo":
    import torch.distributed as dist
else:
    import aiodist.sync as dist
open(out + ".ready", "w").close()
while not os.path.exists(start_file):
    time.sleep(0.005)
if peer == "gloo":
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
else:
    dist.init_process_group("gloo", timeout=300)
joined = time.time()
dist.barrier()
ready = time.time()
dist.destroy_process_group()
with open(out, "w") as f:
    json.dump([joined, ready], f)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _host_of(rank: int, world_size: int, hosts: int) -> dict[str, str]:
    if hosts <= 1:
        return {}
    per_host = -(-world_size // hosts)
    return {"AIODIST_HOST_ID": f"bench-host-{rank // per_host}", "LOCAL_WORLD_SIZE": str(per_host)}


def run_once(peer: str, world_size: int, hosts: int = 1, timeout: float = 600.0) -> tuple[float, float]:
    """(seconds until every rank joined, until every rank passed the first barrier)."""
    with tempfile.TemporaryDirectory(prefix="aiodist-bench-init-") as d:
        start = os.path.join(d, "start")
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(REPO),
        )
        outs = [os.path.join(d, f"rank{r}") for r in range(world_size)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _RANK, peer, start, outs[r]],
                env=dict(env, RANK=str(r), LOCAL_RANK=str(r), **_host_of(r, world_size, hosts)),
            )
            for r in range(world_size)
        ]
        try:
            deadline = time.monotonic() + timeout
            while not all(os.path.exists(o + ".ready") for o in outs):
                if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                    raise RuntimeError(f"{peer}: not every rank of {world_size} started")
                time.sleep(0.05)
            time.sleep(1.0)  # (let the last imports' pages settle)
            began = time.time()
            Path(start + ".tmp").write_text("")
            os.rename(start + ".tmp", start)
            for p in procs:
                if p.wait(max(1.0, deadline - time.monotonic())) != 0:
                    raise RuntimeError(f"{peer}: a rank of {world_size} failed (exit code {p.returncode})")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        times = [json.loads(Path(o).read_text()) for o in outs]
        return max(t[0] for t in times) - began, max(t[1] for t in times) - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-np", default="16,32,64", help="world sizes, comma separated (default 16,32,64)")
    parser.add_argument("-r", type=int, default=2, help="runs of each peer per world size (default 2)")
    parser.add_argument("--peers", default="aiodist,gloo", help="aiodist, gloo or both (default)")
    parser.add_argument("--hosts", type=int, default=1, help="aiodist's ranks on this many hosts (default 1)")
    parser.add_argument("--json", help="also write the runs to this file")
    args = parser.parse_args()
    peers = [p for p in args.peers.split(",") if p]
    rows = []
    print("| ranks | peer | init (s) | init + first barrier (s) |")
    print("|---:|---|---:|---:|")
    for n in (int(x) for x in args.np.split(",")):
        for _ in range(args.r):
            for peer in peers:
                try:
                    joined, ready = run_once(peer, n, args.hosts)
                except RuntimeError as exc:
                    print(f"| {n} | {peer} | failed: {exc} | |", flush=True)
                    rows.append({"ranks": n, "peer": peer, "error": str(exc)})
                    continue
                print(f"| {n} | {peer} | {joined:.2f} | {ready:.2f} |", flush=True)
                rows.append({"ranks": n, "peer": peer, "init_s": joined, "ready_s": ready})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
