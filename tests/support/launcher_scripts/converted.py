"""A torch.distributed script converted by its import line, run under torchrun and aiodist-run.

Each rank writes what it saw to ``$OUT_DIR/attempt_<restart count>_rank_<rank>.json``.
``TORCH_BACKEND_AIODIST=1``: the script unconverted, on torch's backend "aiodist" instead.
``FAIL_ONCE_RANK=<r>``: rank r exits with code 3 in attempt 0, after the collectives (the
others then fail in their barrier, and the launcher restarts the worker group).
``IDLE_ONCE_SECONDS=<s>``: in attempt 0 the other ranks idle that long before the barrier (a
node whose workers are healthy when another node restarts: its agent restarts them uncounted).
"""

from __future__ import annotations

import fractions
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed
from torch.utils.data import DistributedSampler

if os.environ.get("TORCH_BACKEND_AIODIST"):
    # The unconverted script, on aiodist's registered torch backend instead.
    import torch.distributed as dist

    import aiodist.torch  # noqa: F401  (registers "aiodist")

    dist.init_process_group("aiodist")
else:
    import aiodist.sync as dist  # was: import torch.distributed as dist

    dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

total = torch.arange(4, dtype=torch.float32) + rank
dist.all_reduce(total)
word: list[object] = [f"attempt {attempt}, pid {os.getpid()}" if rank == 0 else None]
dist.broadcast_object_list(word, src=0)
# A Fraction travels pickled, which aiodist accepts only from authenticated peers.
thirds: list[object] = [None] * size
dist.all_gather_object(thirds, fractions.Fraction(rank + 1, 3))

# torch's helpers ask torch.distributed, which sees the same job (the sync face's init saw to it).
sampler = DistributedSampler(range(10), seed=attempt)
through_torch = torch.full((2,), float(rank + 1))
torch.distributed.all_reduce(through_torch)

record = {
    "rank": rank,
    "size": size,
    "node": os.environ.get("GROUP_RANK"),
    "pid": os.getpid(),
    "total": total.tolist(),
    "word": word[0],
    "thirds": [str(t) for t in thirds],
    "sampler": list(sampler),
    "through torch": through_torch.tolist(),
}
Path(os.environ["OUT_DIR"], f"attempt_{attempt}_rank_{rank}.json").write_text(json.dumps(record))
if os.environ.get("FAIL_ONCE_RANK") == str(rank) and attempt == 0:
    sys.exit(3)
if os.environ.get("FAIL_ONCE_RANK") and attempt == 0:
    time.sleep(float(os.environ.get("IDLE_ONCE_SECONDS", "0")))
dist.barrier()
dist.destroy_process_group()
