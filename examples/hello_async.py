"""Your first aiodist program, async face: two collectives in flight at once.

aiodist-run --standalone --nproc-per-node 2 examples/hello_async.py
"""

import asyncio

import numpy as np

import aiodist as dist


async def main() -> None:
    await dist.init_process_group("tcp")  # MASTER_ADDR/PORT, RANK, WORLD_SIZE: set by aiodist-run
    rank, size = dist.get_rank(), dist.get_world_size()
    total = np.full(3, rank + 1, dtype=np.float32)
    word = np.array([7, 7] if rank == 0 else [0, 0], dtype=np.int64)
    # Each call starts its operation at once and returns an awaitable Work.
    await asyncio.gather(dist.all_reduce(total), dist.broadcast(word, src=0))
    print(f"rank {rank} of {size}: all_reduce -> {total}, broadcast from rank 0 -> {word}")
    await dist.destroy_process_group()


asyncio.run(main())
