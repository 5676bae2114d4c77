"""A hand-written ring all-reduce with isend/recv, from the PyTorch distributed tutorial.

Each of four ranks passes its buffer to the right neighbour and accumulates what arrives
from the left, size - 1 times; every rank ends with the sum. The result is checked against
``dist.all_reduce``. Only the import line differs from the torch.distributed version.
"""

import os

import torch
from torch.multiprocessing import Process

if os.environ.get("EXAMPLE_BACKEND") == "torch":
    import torch.distributed as dist
else:
    import aiodist.sync as dist


def allreduce(send, recv):
    """Implementation of a ring-reduce."""
    rank = dist.get_rank()
    size = dist.get_world_size()
    send_buff = send.clone()
    recv_buff = send.clone()
    accum = send.clone()

    left = ((rank - 1) + size) % size
    right = (rank + 1) % size

    for i in range(size - 1):
        if i % 2 == 0:
            # Send send_buff
            send_req = dist.isend(send_buff, right)
            dist.recv(recv_buff, left)
            accum[:] += recv_buff[:]
        else:
            # Send recv_buff
            send_req = dist.isend(recv_buff, right)
            dist.recv(send_buff, left)
            accum[:] += send_buff[:]
        send_req.wait()
    recv[:] = accum[:]


def run(rank, size):
    """Ring all-reduce of a small tensor, compared with the library's all_reduce."""
    data = torch.arange(6, dtype=torch.float32) * (rank + 1)
    result = torch.zeros(6)
    allreduce(data, result)
    expected = data.clone()
    dist.all_reduce(expected, op=dist.ReduceOp.SUM)
    same = torch.equal(result, expected)
    print("Rank ", rank, " ring all-reduce ", result.tolist(), " matches all_reduce: ", same, flush=True)
    if not same:
        raise SystemExit(1)


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
