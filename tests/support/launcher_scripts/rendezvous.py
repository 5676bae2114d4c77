"""A real job under the launcher: torch.distributed-style init from the environment it was given."""

from __future__ import annotations

import aiodist.sync as dist

dist.init_process_group("tcp", timeout=10.0)
print(f"joined as {dist.get_rank()} of {dist.get_world_size()}")
dist.destroy_process_group()
