"""Train a small classifier with DistributedDataParallel on local ranks.

    python -m aiodist.run --nproc-per-node 2 examples/ddp_train.py [--steps 30]

Every rank starts from its own random weights (DDP broadcasts rank 0's), trains on its own
shard of a synthetic task, and prints its loss. Buckets are kept small so that several
all_reduces overlap with backward; one step in five accumulates two micro-batches with
``no_sync()``. At the end the ranks compare their parameters: the replicas must be identical.
"""

from __future__ import annotations

import argparse

import torch

import aiodist.sync as dist
from aiodist.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    dist.init_process_group("tcp")  # env:// as set by the launcher
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(rank)  # different initial weights on purpose
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.BatchNorm1d(64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 4),
    )
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)
    if rank == 0:
        print(f"{world} ranks, {len(ddp.bucket_indices)} gradient buckets: {ddp.bucket_indices}", flush=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(1234))  # same task everywhere
    shard = torch.Generator().manual_seed(1 + rank)  # different data on each rank

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, 16, generator=shard)
        return x, (x @ teacher).argmax(dim=1)

    for step in range(args.steps):
        opt.zero_grad()
        if step % 5 == 4:
            x0, y0 = batch(32)
            with ddp.no_sync():  # first micro-batch: gradients stay local
                loss_fn(ddp(x0), y0).backward()
        x, y = batch(32)
        loss = loss_fn(ddp(x), y)
        loss.backward()  # returns with every param.grad averaged over the ranks
        opt.step()
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    lo, hi = flat.clone(), flat.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    print(f"replicas identical: {bool(torch.equal(lo, hi))}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
