"""Every collective of the PyTorch distributed tutorial's table, on four processes.

scatter, gather, reduce, all_reduce, broadcast and all_gather (plus all_to_all,
reduce_scatter and the object collectives), each printed per rank. Only the import line
differs from the torch.distributed version: EXAMPLE_BACKEND=torch prints the same lines.
"""

import os

import torch
from torch.multiprocessing import Process

if os.environ.get("EXAMPLE_BACKEND") == "torch":
    import torch.distributed as dist
else:
    import aiodist.sync as dist


def show(rank, name, value):
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    elif isinstance(value, list):
        value = [v.tolist() if isinstance(v, torch.Tensor) else v for v in value]
    print(f"Rank {rank} {name}: {value}", flush=True)


def run(rank, size):
    """One of each collective; root 0 or the last rank, integer and float tensors."""
    last = size - 1

    t = torch.tensor([rank * 10, rank * 10 + 1], dtype=torch.int64)
    chunks = [torch.full((2,), float(i) + 0.5) for i in range(size)] if rank == 0 else None
    out = torch.zeros(2)
    dist.scatter(out, scatter_list=chunks, src=0)
    show(rank, "scatter", out)

    bucket = [torch.zeros(2, dtype=torch.int64) for _ in range(size)] if rank == last else None
    dist.gather(t, gather_list=bucket, dst=last)
    if rank == last:
        show(rank, "gather", bucket)

    r = torch.tensor([rank + 1.0, 2.0])
    dist.reduce(r, dst=0, op=dist.ReduceOp.PRODUCT)
    if rank == 0:
        show(rank, "reduce", r)

    for op in ("SUM", "MAX", "MIN"):
        a = torch.tensor([rank, -rank, 7], dtype=torch.int32)
        dist.all_reduce(a, op=getattr(dist.ReduceOp, op))
        show(rank, f"all_reduce {op}", a)

    b = torch.arange(3, dtype=torch.float64) if rank == last else torch.zeros(3, dtype=torch.float64)
    dist.broadcast(b, src=last)
    show(rank, "broadcast", b)

    gathered = [torch.zeros(1, dtype=torch.int8) for _ in range(size)]
    dist.all_gather(gathered, torch.tensor([rank * rank], dtype=torch.int8))
    show(rank, "all_gather", gathered)

    send = [torch.tensor([rank * 100 + i]) for i in range(size)]
    recv = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_to_all(recv, send)
    show(rank, "all_to_all", recv)

    mine = torch.zeros(2)
    dist.reduce_scatter(mine, [torch.full((2,), float(rank + i)) for i in range(size)])
    show(rank, "reduce_scatter", mine)

    objs = [{"lr": 0.1, "name": "tour"}, [1, 2, 3]] if rank == 0 else [None, None]
    dist.broadcast_object_list(objs, src=0)
    show(rank, "broadcast_object_list", objs)

    work = dist.all_reduce(torch.ones(1), async_op=True)
    work.wait()
    dist.barrier()
    show(rank, "async all_reduce completed", work.is_completed())


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
