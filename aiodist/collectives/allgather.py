"""all_gather: Bruck's algorithm for small blocks, a pipelined ring for large ones.

Bruck (small, equal blocks): work in a staging buffer where slot i holds the block of rank
r + i. In round k (distance d = 2^k) rank r sends its first min(d, n - d) slots to r - d and
receives as many from r + d behind them, so the filled prefix doubles each round:
ceil(log2 n) rounds for any n (no power-of-two restriction), then one rotation into the
outputs. Staging is n blocks, which is fine because blocks are small.

Ring (large, or blocks of different sizes): in step t rank r passes block r - t to the right
and receives block r - t - 1 from the left. Every receive is posted up front, straight into
the output block it belongs to; blocks are cut into segments and each segment is forwarded
as soon as it lands, so all n links stream at once. No scratch, no copies beyond placing
this rank's own block.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from aiodist.collectives import select
from aiodist.collectives._common import Array, bounds, bv, check_size, copy_into, n_segments, wait_all
from aiodist.collectives.context import OpContext
from aiodist.collectives.steps import Plan, Steps

__all__ = ["allgather", "bruck_allgather_steps", "check_allgather", "ring_allgather"]


def allgather(ctx: OpContext, blocks: Sequence[Array], inp: Array) -> Plan:
    """Fill ``blocks[i]`` (flat, writable) with group rank i's ``inp``; ``blocks[rank]`` gets ours.

    Blocks may differ in size (every rank must pass the same sizes), then the ring runs.
    """
    n = ctx.size
    equal = all(b.size == inp.size for b in blocks)
    if n > 1 and equal and select.allgather_algorithm(inp.nbytes, n) == "bruck":
        return bruck_allgather_steps(ctx, blocks, inp)
    return ring_allgather(ctx, blocks, inp)


def check_allgather(ctx: OpContext, blocks: Sequence[Array], inp: Array) -> None:
    """One output block per rank, ours ``inp``'s size. Every form of all_gather checks this first,
    inside the operation (a generator's first step, a coroutine's first line): a bad call fails
    its Work, as any other failure of the operation."""
    check_size("all_gather output list length", len(blocks), ctx.size)
    check_size("all_gather own block", blocks[ctx.rank].size, inp.size)


def bruck_allgather_steps(ctx: OpContext, blocks: Sequence[Array], inp: Array) -> Steps:
    """Bruck's all_gather as steps (``aiodist.collectives.steps``)."""
    check_allgather(ctx, blocks, inp)
    n, r, b = ctx.size, ctx.rank, inp.size
    tmp = np.empty(n * b, dtype=inp.dtype)
    tmp[:b] = inp
    have = 1
    while have < n:
        m = min(have, n - have)
        received = ctx.recv((r + have) % n, bv(tmp[have * b : (have + m) * b]))
        yield (ctx.send((r - have) % n, bv(tmp[: m * b])), received)
        have += m
    for i in range(n):
        copy_into(blocks[(r + i) % n], tmp[i * b : (i + 1) * b])


async def ring_allgather(ctx: OpContext, blocks: Sequence[Array], inp: Array) -> None:
    check_allgather(ctx, blocks, inp)
    n, r = ctx.size, ctx.rank
    if n == 1:
        copy_into(blocks[0], inp)
        return
    right, left = (r + 1) % n, (r - 1) % n
    seg = select.segment_elems(inp.itemsize)

    def segments(a: Array) -> list[Array]:
        sb = bounds(a.size, n_segments(a.size, seg))
        return [a[sb[j] : sb[j + 1]] for j in range(len(sb) - 1)]

    # Receives in the order the left neighbour sends: block r-1, r-2, ..., r-n+1.
    incoming = [(c, s) for t in range(n - 1) for c in [(r - 1 - t) % n] for s in segments(blocks[c])]
    recvs = [ctx.recv(left, bv(s)) for _, s in incoming]
    sends = [ctx.send(right, bv(s)) for s in segments(inp)]
    copy_into(blocks[r], inp)
    for (c, s), rv in zip(incoming, recvs, strict=True):
        await rv
        if c != (r + 1) % n:  # block r+1 has gone all the way round
            sends.append(ctx.send(right, bv(s)))
    await wait_all(sends)
