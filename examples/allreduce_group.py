"""Collective communication in a group, from the PyTorch distributed tutorial.

Four processes; ranks 0 and 1 form a group and all-reduce a tensor of ones in it. Ranks 2
and 3 are not members: ``new_group`` hands them ``GroupMember.NON_GROUP_MEMBER`` and the
all-reduce is skipped on them (with a warning), as torch.distributed does. Only the import
line differs from the torch.distributed version (EXAMPLE_BACKEND=torch runs it on gloo).
"""

import os

import torch
from torch.multiprocessing import Process

if os.environ.get("EXAMPLE_BACKEND") == "torch":
    import torch.distributed as dist
else:
    import aiodist.sync as dist


def run(rank, size):
    """Simple collective communication."""
    group = dist.new_group([0, 1])
    tensor = torch.ones(1)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    print("Rank ", rank, " has data ", tensor[0].item(), flush=True)


def init_process(rank, size, fn, backend="gloo"):
    """Initialize the distributed environment."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(rank, size)
    dist.destroy_process_group()


if __name__ == "__main__":
    size = 4
    processes = []
    for rank in range(size):
        p = Process(target=init_process, args=(rank, size, run))
        p.start()
        processes.append(p)
    for p in processes:
        p.join()
    raise SystemExit(max(abs(p.exitcode or 0) for p in processes))
