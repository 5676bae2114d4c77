"""Many collectives in flight at once: one ``asyncio.gather`` over all_reduce, broadcast,
all_gather, reduce_scatter and all_to_all calls of different sizes and ops.

Every call starts its operation at once and returns an awaitable Work; collectives on a
group are matched across ranks by call order, so they may complete in any order. Run with
the launcher:

    python -m aiodist.run --nproc-per-node 4 examples/gather_many.py
"""

import asyncio
import os

import numpy as np
import uvloop

import aiodist as dist


async def main() -> None:
    await dist.init_process_group("tcp", "env://")
    rank, size = dist.get_rank(), dist.get_world_size()
    loop = asyncio.get_running_loop()

    sums = [np.full(n, rank + 1, np.int64) for n in (1, 100, 10_000, 1_000_000)]
    maxes = [np.full(n, rank, np.float32) for n in (7, 70_000)]
    avg = np.full(3_000_000, float(rank), np.float64)  # 24 MB: the pipelined ring
    bcast = np.arange(500_000, dtype=np.float32) if rank == 0 else np.zeros(500_000, np.float32)
    gathered = np.zeros(4 * size, np.int32)
    scattered = np.zeros(2, np.int64)
    exchanged = np.zeros(size, np.int16)

    start = loop.time()
    await asyncio.gather(
        *(dist.all_reduce(t) for t in sums),
        *(dist.all_reduce(t, dist.ReduceOp.MAX) for t in maxes),
        dist.all_reduce(avg, dist.ReduceOp.AVG),
        dist.broadcast(bcast, src=0),
        dist.all_gather_into_tensor(gathered, np.full(4, rank, np.int32)),
        dist.reduce_scatter_tensor(scattered, np.arange(2 * size, dtype=np.int64)),
        dist.all_to_all_single(exchanged, np.full(size, rank, np.int16)),
    )
    elapsed = loop.time() - start

    ok = (
        all((t == size * (size + 1) // 2).all() for t in sums)
        and all((t == size - 1).all() for t in maxes)
        and bool((avg == (size - 1) / 2).all())
        and bool((bcast == np.arange(500_000)).all())
        and gathered.tolist() == [r for r in range(size) for _ in range(4)]
        and scattered.tolist() == [size * 2 * rank, size * (2 * rank + 1)]
        and exchanged.tolist() == list(range(size))
    )
    print(
        f"rank {rank}: 11 collectives in flight at once, all {'correct' if ok else 'WRONG'} "
        f"in {elapsed * 1e3:.1f} ms",
        flush=True,
    )
    await dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    uvloop.run(main())
