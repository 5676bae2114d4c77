"""A real job whose rank 1 goes wrong while the others are in a collective.

``raise``: rank 1 raises ValueError instead of entering the all_reduce the others wait in.
``mismatch``: rank 1 all_reduces 20 float32 where the others all_reduce 10.
``kill``: rank 1 writes a line naming rank 0 to stderr, then SIGKILLs itself.
Either way every rank exits on its own; the launcher's summary must blame rank 1.
"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np

import aiodist.sync as dist


def step(rank: int, mode: str) -> None:
    if rank == 1 and mode == "raise":
        raise ValueError("bad batch on rank 1")
    if rank == 1 and mode == "kill":
        print("rank 1: rank 0 is waiting for my gradients", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    count = 20 if rank == 1 and mode == "mismatch" else 10
    dist.all_reduce(np.ones(count, np.float32))


def main() -> None:
    mode = sys.argv[1]
    dist.init_process_group("gloo", timeout=60)
    dist.barrier()
    step(dist.get_rank(), mode)
    dist.destroy_process_group()


main()
