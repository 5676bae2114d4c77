"""An asynchronous pipeline: stage r receives a micro-batch from stage r-1, works on it, sends it on.

Every stage keeps many micro-batches in flight at once: receives for all of them are posted
up front, each is processed the moment it lands, and sends go out without waiting for the
next stage. Run it with the launcher (4 stages):

    python -m aiodist.run --nproc-per-node 4 examples/async_pipeline.py
"""

import asyncio
import os

import numpy as np
import uvloop

import aiodist as dist

MICRO_BATCHES = 16
WIDTH = 1024


async def stage_work(x: np.ndarray, rank: int) -> None:
    """This stage's "layer": add the stage number (and yield, as real work would)."""
    x += rank
    await asyncio.sleep(0)


async def handle(i: int, rank: int, size: int) -> float:
    buf = np.empty(WIDTH, dtype=np.float32)
    if rank == 0:
        buf[:] = i  # stage 0 makes the micro-batch
    else:
        await dist.recv(buf, src=rank - 1, tag=i)
    await stage_work(buf, rank)
    if rank < size - 1:
        await dist.send(buf, dst=rank + 1, tag=i)
    return float(buf[0])


async def main() -> None:
    await dist.init_process_group("tcp", "env://")
    rank, size = dist.get_rank(), dist.get_world_size()
    loop = asyncio.get_running_loop()
    start = loop.time()
    # All micro-batches in flight at once; each flows through the stage as soon as it arrives.
    results = await asyncio.gather(*(handle(i, rank, size) for i in range(MICRO_BATCHES)))
    elapsed = loop.time() - start
    if rank == size - 1:
        expected = [i + sum(range(size)) for i in range(MICRO_BATCHES)]
        ok = results == expected
        print(
            f"last stage {rank}: {MICRO_BATCHES} micro-batches of {WIDTH} floats, first values "
            f"{results[:4]}... {'correct' if ok else 'WRONG'} in {elapsed * 1e3:.1f} ms",
            flush=True,
        )
        if not ok:
            raise SystemExit(1)
    else:
        print(f"stage {rank}: forwarded {MICRO_BATCHES} micro-batches to stage {rank + 1}", flush=True)
    await dist.barrier()
    await dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    uvloop.run(main())
