"""One rank of a long job for the failure tests (sync face, as a torch.distributed script).

``MODE``:

- ``loop`` (default): all_reduce steps, each result checked, until something breaks;
- ``idle``: a few steps, then the ranks of host 0 wait for a message from rank ``size // 2``
  (the first rank of the next host), which never sends it: when that host is cut off, nothing
  of theirs is in flight, only the waiting;
- ``raise``: as ``loop``, but rank ``FAIL_RANK`` raises ``ValueError`` at step 10.

Every rank writes ``$OUT_DIR/ready_<RANK>`` after 5 steps; on a ``DistError`` it writes
``$OUT_DIR/error_<RANK>.json`` (the error's class and message, and the wall-clock time it was
raised, which the test compares with the moment it broke something: the hosts share the
machine's clock), then lets it propagate, so that the launcher reports it.
``GROUP_TIMEOUT``: the group's timeout in seconds (120).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

import aiodist.sync as dist
from aiodist import DistError

out = Path(os.environ["OUT_DIR"])
mode = os.environ.get("MODE", "loop")
dist.init_process_group("gloo", timeout=float(os.environ.get("GROUP_TIMEOUT", "120")))
rank, size = dist.get_rank(), dist.get_world_size()
step = 0
try:
    while True:
        x = np.full(1 << 16, rank + step, np.float32)
        dist.all_reduce(x)
        assert (x == sum(r + step for r in range(size))).all(), f"step {step}: wrong sum {x[0]}"
        step += 1
        if step == 5:
            (out / f"ready_{rank}").touch()
            if mode == "idle":
                if rank < size // 2:
                    dist.recv(np.zeros(1), src=size // 2)
                else:
                    time.sleep(3600)
        if mode == "raise" and step == 10 and rank == int(os.environ["FAIL_RANK"]):
            raise ValueError(f"rank {rank} fails on purpose at step {step}")
        time.sleep(0.01)
except DistError as exc:
    report = {"rank": rank, "step": step, "type": type(exc).__name__, "message": str(exc), "at": time.time()}
    (out / f"error_{rank}.json").write_text(json.dumps(report))
    raise
