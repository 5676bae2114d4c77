"""Non-blocking point-to-point communication, from the PyTorch distributed tutorial.

Rank 0 isends a tensor to rank 3, which irecvs it; both wait on the request before using
the tensor. Only the import line differs from the torch.distributed version.
"""

import os

import torch
from torch.multiprocessing import Process

if os.environ.get("EXAMPLE_BACKEND") == "torch":
    import torch.distributed as dist
else:
    import aiodist.sync as dist


def run(rank, size):
    """Non-blocking point-to-point communication."""
    tensor = torch.zeros(1)
    req = None
    if rank == 0:
        tensor += 1
        # Send the tensor to process 3
        req = dist.isend(tensor=tensor, dst=3)
        print("Rank 0 started sending", flush=True)
    elif rank == 3:
        # Receive tensor from process 0
        req = dist.irecv(tensor=tensor, src=0)
        print("Rank 3 started receiving", flush=True)
    if req is not None:
        req.wait()
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
