"""A training script for aiodist-run / torchrun, which describe each worker in its environment.

    aiodist-run --nproc-per-node 2 examples/launch_env.py     (or python -m aiodist.run ...)
    (torch: torchrun --nproc-per-node 2 examples/launch_env.py)

The launcher sets MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK and
LOCAL_WORLD_SIZE, so ``init_process_group("gloo")`` needs no arguments. Rank 0 broadcasts a
configuration, every rank contributes a row to an ``all_gather``, and rank 0 gathers each
rank's LOCAL_RANK. Only the import line differs from the torch.distributed version.
"""

import os

import torch

if os.environ.get("EXAMPLE_BACKEND") == "torch":
    import torch.distributed as dist
else:
    import aiodist.sync as dist

local_rank = int(os.environ["LOCAL_RANK"])
local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()

config = torch.tensor([0.5, 64.0]) if rank == 0 else torch.zeros(2)
dist.broadcast(config, src=0)

rows = [torch.zeros(3, dtype=torch.int64) for _ in range(world_size)]
dist.all_gather(rows, torch.tensor([rank, local_rank, rank * rank]))

local_ranks = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)] if rank == 0 else None
dist.gather(torch.tensor([local_rank]), local_ranks, dst=0)

print(
    f"Rank {rank} of {world_size} (local {local_rank} of {local_world_size}): "
    f"launched by an elastic launcher: {dist.is_torchelastic_launched()}, "
    f"config {config.tolist()}, rows {[r.tolist() for r in rows]}",
    flush=True,
)
if rank == 0:
    print(f"Rank 0 gathered local ranks {[int(t) for t in local_ranks]}", flush=True)
dist.destroy_process_group()
