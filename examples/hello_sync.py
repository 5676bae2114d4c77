"""Your first aiodist program, sync face: a torch.distributed script with one line changed.

aiodist-run --standalone --nproc-per-node 2 examples/hello_sync.py
"""

import torch

import aiodist.sync as dist  # was: import torch.distributed as dist

dist.init_process_group("gloo")  # MASTER_ADDR/PORT, RANK, WORLD_SIZE: set by aiodist-run
rank, size = dist.get_rank(), dist.get_world_size()
tensor = torch.full((3,), float(rank + 1))
dist.all_reduce(tensor)  # blocks until every rank has contributed
print(f"rank {rank} of {size}: all_reduce -> {tensor.tolist()}")
dist.destroy_process_group()
