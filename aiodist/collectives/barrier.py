"""Dissemination barrier.

How it works: in round k (k = 0 .. ceil(log2 n) - 1) rank r sends an empty message to
(r + 2^k) mod n and waits for one from (r - 2^k) mod n. After the last round every rank has
heard, directly or through a chain, from every other rank, so none can leave before all
have arrived. ceil(log2 n) rounds, n messages per round, no root to queue on.
"""

from __future__ import annotations

from aiodist.collectives.context import OpContext

__all__ = ["barrier"]

_EMPTY = memoryview(bytearray(0))


async def barrier(ctx: OpContext) -> None:
    n, r = ctx.size, ctx.rank
    dist = 1
    while dist < n:
        await ctx.sendrecv((r + dist) % n, _EMPTY, (r - dist) % n, memoryview(bytearray(0)))
        dist *= 2
