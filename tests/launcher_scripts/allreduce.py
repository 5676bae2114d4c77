"""A real job under the launcher: torch.distributed-style init from the environment, one all_reduce."""

from __future__ import annotations

import numpy as np

import aiodist.sync as dist

dist.init_process_group("tcp", timeout=20.0)
rank, world = dist.get_rank(), dist.get_world_size()
values = np.full(4, rank + 1, dtype=np.int64)
dist.all_reduce(values)
print(f"sum {values.tolist()} on {rank} of {world}")
dist.destroy_process_group()
