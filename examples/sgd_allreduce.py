"""Distributed synchronous SGD, from the PyTorch distributed tutorial.

Two processes train one small network on their own partition of a dataset; after every
backward pass each rank all-reduces every gradient and divides by the world size, so all
ranks take the same step. The tutorial's MNIST download is replaced by a synthetic,
seeded classification set (no downloads). Only the import line differs from the
torch.distributed version (EXAMPLE_BACKEND=torch runs it on gloo); both print the same losses.
"""

import os
from math import ceil
from random import Random

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.multiprocessing import Process

if os.environ.get("EXAMPLE_BACKEND") == "torch":
    import torch.distributed as dist
else:
    import aiodist.sync as dist

EPOCHS = 5


class Partition:
    """Dataset-like object, but only access a subset of it."""

    def __init__(self, data, index):
        self.data = data
        self.index = index

    def __len__(self):
        return len(self.index)

    def __getitem__(self, index):
        data_idx = self.index[index]
        return self.data[data_idx]


class DataPartitioner:
    """Partitions a dataset into different chunks."""

    def __init__(self, data, sizes=(0.7, 0.2, 0.1), seed=1234):
        self.data = data
        self.partitions = []
        rng = Random()
        rng.seed(seed)
        data_len = len(data)
        indexes = list(range(data_len))
        rng.shuffle(indexes)

        for frac in sizes:
            part_len = int(frac * data_len)
            self.partitions.append(indexes[0:part_len])
            indexes = indexes[part_len:]

    def use(self, partition):
        return Partition(self.data, self.partitions[partition])


def synthetic_dataset(n=1024, features=16, classes=4, seed=0):
    """A seeded stand-in for MNIST: points labelled by a random linear teacher."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    teacher = torch.randn(features, classes, generator=g)
    y = (x @ teacher).argmax(dim=1)
    return torch.utils.data.TensorDataset(x, y)


def partition_dataset():
    """Partitioning the dataset: one equal share per rank."""
    dataset = synthetic_dataset()
    size = dist.get_world_size()
    bsz = 128 // size
    partition_sizes = [1.0 / size for _ in range(size)]
    partition = DataPartitioner(dataset, partition_sizes)
    partition = partition.use(dist.get_rank())
    train_set = torch.utils.data.DataLoader(partition, batch_size=bsz, shuffle=True)
    return train_set, bsz


class Net(nn.Module):
    """A small multilayer perceptron."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


def average_gradients(model):
    """Gradient averaging."""
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= size


def run(rank, size):
    """Distributed Synchronous SGD Example."""
    torch.set_num_threads(1)  # small model: one thread per rank, and bit-for-bit repeatable
    torch.manual_seed(1234)
    train_set, bsz = partition_dataset()
    model = Net()
    optimizer = optim.SGD(model.parameters(), lr=0.1, momentum=0.5)

    num_batches = ceil(len(train_set.dataset) / float(bsz))
    for epoch in range(EPOCHS):
        epoch_loss = 0.0
        for data, target in train_set:
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            epoch_loss += loss.item()
            loss.backward()
            average_gradients(model)
            optimizer.step()
        print(f"Rank {dist.get_rank()}, epoch {epoch}: loss {epoch_loss / num_batches:.6f}", flush=True)
    # Every rank took the same steps: the weights agree everywhere.
    checksum = torch.tensor([sum(p.detach().double().sum().item() for p in model.parameters())])
    copies = [torch.zeros(1, dtype=torch.float64) for _ in range(size)]
    dist.all_gather(copies, checksum.double())
    agree = all(torch.equal(c, copies[0]) for c in copies)
    print(f"Rank {rank}: weight checksum {checksum.item():.6f}, same on every rank: {agree}", flush=True)
    if not agree:
        raise SystemExit(1)


def init_process(rank, size, fn, backend="gloo"):
    """Initialize the distributed environment."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(rank, size)
    dist.destroy_process_group()


if __name__ == "__main__":
    size = 2
    processes = []
    for rank in range(size):
        p = Process(target=init_process, args=(rank, size, run))
        p.start()
        processes.append(p)
    for p in processes:
        p.join()
    raise SystemExit(max(abs(p.exitcode or 0) for p in processes))
