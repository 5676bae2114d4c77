"""broadcast: binomial tree for small buffers, pipelined chain for large ones.

Ranks are numbered relative to the root (v = (r - root) mod n). Binomial tree (small):
rank v receives the whole buffer from v - 2^k, where 2^k is v's lowest set bit, then
sends it on to v + 2^m for every 2^m below that bit, largest first: ceil(log2 n) rounds,
each rank sends and receives the buffer at most once per round.

Pipelined chain (large): the buffer is cut into segments and flows root -> v1 -> v2 ...
Every receive is posted up front, straight into the user's buffer, and each segment is
forwarded the moment it lands, so all links carry data at once and the time is about
(n - 2 + segments) segment transfers instead of log2(n) whole-buffer transfers.
No copies and no scratch in either algorithm.
"""

from __future__ import annotations

from aiodist.collectives import select
from aiodist.collectives._common import Array, bounds, bv, n_segments, wait_all
from aiodist.collectives.context import OpContext
from aiodist.collectives.steps import Plan, Steps, no_steps

__all__ = ["broadcast", "chain_broadcast", "tree_broadcast_steps"]


def broadcast(ctx: OpContext, arr: Array, root: int) -> Plan:
    """Copy group rank ``root``'s ``arr`` into every other rank's ``arr`` (same size everywhere)."""
    if ctx.size == 1:
        return no_steps()
    if select.broadcast_algorithm(arr.nbytes, ctx.size) == "chain":
        return chain_broadcast(ctx, arr, root)
    return tree_broadcast_steps(ctx, arr, root)


def tree_broadcast_steps(ctx: OpContext, arr: Array, root: int) -> Steps:
    """The binomial tree as steps (``aiodist.collectives.steps``)."""
    n = ctx.size
    v = (ctx.rank - root) % n
    buf = bv(arr)
    mask = 1
    while mask < n:
        if v & mask:
            yield (ctx.recv((v - mask + root) % n, buf),)
            break
        mask <<= 1
    mask >>= 1
    sends = []
    while mask > 0:
        if v + mask < n:
            sends.append(ctx.send((v + mask + root) % n, buf))
        mask >>= 1
    yield tuple(sends)


async def chain_broadcast(ctx: OpContext, arr: Array, root: int) -> None:
    n = ctx.size
    v = (ctx.rank - root) % n
    nseg = n_segments(arr.size, select.segment_elems(arr.itemsize))
    sb = bounds(arr.size, nseg)
    segs = [bv(arr[sb[j] : sb[j + 1]]) for j in range(nseg)]
    left, right = (ctx.rank - 1) % n, (ctx.rank + 1) % n
    last = v == n - 1
    sends = []
    if v == 0:
        sends = [ctx.send(right, s) for s in segs]
    else:
        recvs = [ctx.recv(left, s) for s in segs]
        for s, rv in zip(segs, recvs, strict=True):
            await rv
            if not last:
                sends.append(ctx.send(right, s))
    await wait_all(sends)
