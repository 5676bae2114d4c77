"""Dissemination barrier.

How it works: in round k (k = 0 .. ceil(log2 n) - 1) rank r sends an empty message to
(r + 2^k) mod n and waits for one from (r - 2^k) mod n. After the last round every rank has
heard, directly or through a chain, from every other rank, so none can leave before all
have arrived. ceil(log2 n) rounds, n messages per round, no root to queue on.
"""

from __future__ import annotations

from aiodist.collectives.context import OpContext
from aiodist.collectives.steps import Steps

__all__ = ["barrier_steps"]

_EMPTY = memoryview(bytearray(0))


def barrier_steps(ctx: OpContext) -> Steps:
    """The barrier as steps (``aiodist.collectives.steps``)."""
    n, r = ctx.size, ctx.rank
    dist = 1
    while dist < n:
        received = ctx.recv((r - dist) % n, memoryview(bytearray(0)))
        yield (ctx.send((r + dist) % n, _EMPTY), received)
        dist *= 2
