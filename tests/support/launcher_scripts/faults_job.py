"""A real job for the launcher fault tests: init, then all_reduce steps checked every time.

``--steps N`` (0: until killed). Every rank writes ``$OUT_DIR/ready_<RANK>`` after a few
steps; a ``DistNetworkError`` is reported on stderr (the launcher's summary shows it).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

import aiodist.sync as dist

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=0)
args = parser.parse_args()
out = Path(os.environ["OUT_DIR"])

dist.init_process_group("gloo", timeout=30)
rank, size = dist.get_rank(), dist.get_world_size()
step = 0
while args.steps == 0 or step < args.steps:
    x = np.full(1 << 16, rank + step, np.float32)
    dist.all_reduce(x)
    assert (x == sum(r + step for r in range(size))).all()
    step += 1
    if step == 5:
        (out / f"ready_{rank}").touch()
    time.sleep(0.01)
print(f"rank {rank} of {size} finished {step} steps", flush=True)
dist.destroy_process_group()
