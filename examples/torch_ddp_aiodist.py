"""Plain PyTorch training (torch's DDP, DistributedSampler, DataLoader) on the aiodist backend.

    python -m aiodist.run --nproc-per-node 2 examples/torch_ddp_aiodist.py [--epochs 3]
    torchrun --nproc-per-node 2 examples/torch_ddp_aiodist.py --backend gloo   # the same on gloo

Nothing here is aiodist's API but the import that registers the backend and the word
"aiodist": the model is wrapped in ``torch.nn.parallel.DistributedDataParallel``, each rank
reads its own shard of the data set through ``torch.utils.data.DistributedSampler``. Each
epoch rank 0 prints the loss averaged over the ranks; at the end the ranks compare a checksum
of their parameters, which must be identical. The first run on a machine builds the backend's
small C++ extension (about a minute; cached afterwards).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import aiodist.torch  # noqa: F401  (registers backend "aiodist" with torch.distributed)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--backend", default="aiodist")
    args = parser.parse_args()

    dist.init_process_group(args.backend)  # env:// as set by the launcher
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    # The same synthetic data set on every rank; the sampler gives each rank its own part.
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(512, 16, generator=gen)
    y = (x @ torch.randn(16, 4, generator=gen)).argmax(dim=1)
    sampler = DistributedSampler(TensorDataset(x, y), shuffle=True, seed=0)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, sampler=sampler)

    torch.manual_seed(rank)  # different initial weights on purpose: DDP broadcasts rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        total = torch.zeros(2)
        for xb, yb in loader:
            opt.zero_grad()
            loss = loss_fn(ddp(xb), yb)
            loss.backward()  # DDP averages the gradients over the ranks during backward
            opt.step()
            total += torch.tensor([loss.item() * len(yb), len(yb)])
        dist.all_reduce(total)
        if rank == 0:
            print(
                f"epoch {epoch}: mean loss {total[0].item() / total[1].item():.4f} over {int(total[1])} samples"
            )

    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    sums: list[float | None] = [None] * world
    dist.all_gather_object(sums, checksum)
    if rank == 0:
        same = all(s == sums[0] for s in sums)
        print(f"{world} ranks on {dist.get_backend()}: parameters identical on every rank: {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
