"""Explicit arguments win over the environment: a one-process "job" that trains a linear model.

The environment claims ``WORLD_SIZE=2``, but ``init_process_group(rank=0, world_size=1)``
says otherwise, and the explicit arguments win, so this single process forms a complete
group of one on its own. It then fits ``y = 3x + 2`` by gradient descent, averaging the
gradients over the (one-rank) world as a data-parallel program would. Only the import line
differs from the torch.distributed version (EXAMPLE_BACKEND=torch runs it on gloo).
"""

import os

import torch
import torch.nn as nn
import torch.optim as optim

if os.environ.get("EXAMPLE_BACKEND") == "torch":
    import torch.distributed as dist
else:
    import aiodist.sync as dist

# MASTER_ADDR / MASTER_PORT, and an environment that says "rank 0 of 2"
os.environ["MASTER_ADDR"] = "127.0.0.1"
os.environ.setdefault("MASTER_PORT", "29505")
os.environ["RANK"] = "0"
os.environ["WORLD_SIZE"] = "2"

# The explicit world_size=1 overrides WORLD_SIZE=2: no second process is awaited
dist.init_process_group(backend="gloo", rank=0, world_size=1)
print(f"Rank: {dist.get_rank()}, World size: {dist.get_world_size()}", flush=True)


class LinearModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(1, 1)

    def forward(self, x):
        return self.linear(x)


torch.manual_seed(0)
torch.set_num_threads(1)
model = LinearModel()
criterion = nn.MSELoss()
optimizer = optim.SGD(model.parameters(), lr=0.1)

# Random data around y = 3x + 2
x = torch.randn(100, 1)
y = 3 * x + 2 + torch.randn(100, 1) * 0.1

for epoch in range(10):
    optimizer.zero_grad()
    outputs = model(x)
    loss = criterion(outputs, y)
    loss.backward()
    for p in model.parameters():  # average gradients over the world (of one)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= dist.get_world_size()
    optimizer.step()
    print(f"Rank {dist.get_rank()}, epoch {epoch}: loss {loss.item():.6f}", flush=True)

w, b = model.linear.weight.item(), model.linear.bias.item()
print(f"Rank {dist.get_rank()} learned y = {w:.4f}x + {b:.4f}", flush=True)
dist.destroy_process_group()  # release resources
