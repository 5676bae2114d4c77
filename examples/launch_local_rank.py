"""A training script for the legacy launcher, which passes ``--local_rank`` on the command line.

    python -m aiodist.launch --nproc_per_node=2 examples/launch_local_rank.py
    (torch: python -m torch.distributed.launch --nproc_per_node=2 examples/launch_local_rank.py)

The script parses ``--local_rank`` (torch >= 2.0's launcher spells it ``--local-rank``: both
are accepted), joins with ``init_method='env://'`` (the launcher sets MASTER_ADDR,
MASTER_PORT, RANK and WORLD_SIZE), picks its device by local rank (the CPU here; a GPU with
NCCL), then averages a tensor over the job. Only the import line differs from the
torch.distributed version (EXAMPLE_BACKEND=torch runs it on gloo).
"""

import argparse
import os

import torch

if os.environ.get("EXAMPLE_BACKEND") == "torch":
    import torch.distributed as dist
else:
    import aiodist.sync as dist

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", "--local-rank", type=int)
args = parser.parse_args()

# torch.cuda.set_device(args.local_rank) on a GPU machine; the CPU here
device = torch.device("cpu")
dist.init_process_group(backend="gloo", init_method="env://")
rank, world_size = dist.get_rank(), dist.get_world_size()

t = torch.tensor([float(rank + 1), 10.0 * (rank + 1)], device=device)
dist.all_reduce(t, op=dist.ReduceOp.SUM)
t /= world_size
print(f"Rank {rank} (local_rank {args.local_rank}) of {world_size}: average {t.tolist()}", flush=True)
dist.destroy_process_group()
