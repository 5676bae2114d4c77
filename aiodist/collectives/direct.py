"""Direct collectives for a group whose ranks share one host: every rank talks to every rank.

Over shared memory a message costs one copy whoever sends it (the receiver reads the
sender's buffer), so the relays of rings, chains and trees only add copies; these forms move
each byte once from where it is to where it must be.

Broadcast: the root sends its buffer to every other rank (each receiver reads the root's
buffer). All-gather: every rank sends its block to every other rank, received straight into
the output blocks. All-to-all is already direct (``alltoall``). No scratch, no copies.

Reduce-scatter (segmented): rank c owns output block c. Blocks are cut into segments; for
segment j every rank sends its part of each block c to c, and each owner receives its
segment j from every peer into a scratch slot and folds them into its own part (its own
contribution first, then the peers' in rank order from its right: one fixed order per owner).
``select.DIRECT_DEPTH`` segments are in flight: a rank sends segment j + depth only once it
has reduced its segment j, so the scratch stays at depth x (size - 1) segments and the loop
is never blocked for longer than one segment's reduction (in a worker thread when large).

All-reduce: the reduce-scatter above over n chunks of the buffer, and the moment an owner has
finished a segment of its chunk it sends it to every peer, received straight into their
buffers (the all-gather, overlapped with the next segments' reductions). One rank reduces
each chunk and the others copy it: every rank ends with the same bytes. Every message of a
pair travels in one fixed order (segment 0..depth-1 contributions, then for each j the
finished segment j and the contribution of j + depth), and both ends post in that order.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from aiodist.collectives import select
from aiodist.collectives._common import (
    Array,
    bounds,
    bv,
    check_size,
    copy_into,
    finalize,
    n_segments,
    reduce_into,
    wait_all,
)
from aiodist.collectives.allgather import check_allgather
from aiodist.collectives.context import OpContext
from aiodist.collectives.steps import Steps
from aiodist.ops import ReduceOp

__all__ = ["direct_allgather_steps", "direct_allreduce", "direct_broadcast_steps", "direct_reduce_scatter"]


def direct_broadcast_steps(ctx: OpContext, arr: Array, root: int) -> Steps:
    """The root sends to every other rank at once (steps: ``aiodist.collectives.steps``)."""
    n, r = ctx.size, ctx.rank
    if r != root:
        yield (ctx.recv(root, bv(arr)),)
        return
    yield tuple(ctx.send((root + k) % n, bv(arr)) for k in range(1, n))


def direct_allgather_steps(ctx: OpContext, blocks: Sequence[Array], inp: Array) -> Steps:
    """Every rank sends its block to every other at once (steps: ``aiodist.collectives.steps``)."""
    check_allgather(ctx, blocks, inp)
    n, r = ctx.size, ctx.rank
    recvs = [ctx.recv((r - k) % n, bv(blocks[(r - k) % n])) for k in range(1, n)]
    sends = [ctx.send((r + k) % n, bv(inp)) for k in range(1, n)]
    copy_into(blocks[r], inp)
    yield (*recvs, *sends)


async def direct_reduce_scatter(ctx: OpContext, out: Array, blocks: Sequence[Array], op: ReduceOp) -> None:
    n, r = ctx.size, ctx.rank
    check_size("reduce_scatter input list length", len(blocks), n)
    for b in blocks:
        check_size("reduce_scatter input block", b.size, out.size)
    seg = select.segment_elems(out.itemsize)
    nseg = n_segments(out.size, seg)
    sb = bounds(out.size, nseg)

    def part(a: Array, j: int) -> Array:
        return a[sb[j] : sb[j + 1]]

    def contribution(c: int, j: int) -> Array:
        return part(blocks[c], j)

    def own(j: int) -> Array:
        mine = part(out, j)
        copy_into(mine, part(blocks[r], j))  # our contribution first (a no-op in place)
        return mine

    await _reduce_owned(ctx, op, out.dtype, nseg, contribution, own, lambda j: part(out, j).size, None)


async def direct_allreduce(ctx: OpContext, arr: Array, op: ReduceOp) -> None:
    n, r = ctx.size, ctx.rank
    cb = bounds(arr.size, n)
    seg = select.segment_elems(arr.itemsize)
    nseg = n_segments(max(cb[c + 1] - cb[c] for c in range(n)), seg)

    def region(c: int, j: int) -> Array:
        lo, hi = cb[c], cb[c + 1]
        length = hi - lo
        return arr[lo + j * length // nseg : lo + (j + 1) * length // nseg]

    peers = [(r + k) % n for k in range(1, n)]
    finished: list[Awaitable[Any]] = []
    shares: list[Awaitable[None]] = []

    def before(j: int) -> None:
        # Posted ahead of the contributions of segment j + depth: the order the owners send in.
        finished.extend(ctx.recv(c, bv(region(c, j))) for c in peers)

    def after(j: int) -> None:
        done = region(r, j)
        shares.extend(ctx.send(c, bv(done)) for c in peers)

    await _reduce_owned(
        ctx, op, arr.dtype, nseg, region, lambda j: region(r, j), lambda j: region(r, j).size, (before, after)
    )
    await wait_all(finished)
    await wait_all(shares)


async def _reduce_owned(
    ctx: OpContext,
    op: ReduceOp,
    dtype: np.dtype[Any],
    nseg: int,
    contribution: Callable[[int, int], Array],
    own: Callable[[int], Array],
    own_len: Callable[[int], int],
    hooks: tuple[Callable[[int], None], Callable[[int], None]] | None,
) -> None:
    """The segmented direct reduce-scatter: ``contribution(c, j)`` goes to owner c as its
    segment j; ``own(j)`` (holding this rank's contribution) receives the reduction.

    ``hooks``: ``before(j)`` runs before segment j is awaited, ``after(j)`` once it is final;
    each may post or send messages of its own between the contributions (see the module's
    note on the order of a pair's messages).
    """
    n, r = ctx.size, ctx.rank
    peers = [(r + k) % n for k in range(1, n)]
    depth = max(1, min(select.DIRECT_DEPTH, nseg))
    slot_len = max([own_len(j) for j in range(nseg)] + [1])
    scratch = np.empty(depth * (n - 1) * slot_len, dtype=dtype)
    recvs: dict[int, list[Awaitable[Any]]] = {}
    sends: list[Awaitable[None]] = []

    def slot(j: int, i: int) -> Array:
        k = (j % depth) * (n - 1) + i
        return scratch[k * slot_len : k * slot_len + own_len(j)]

    def post(j: int) -> None:
        if j < nseg:
            recvs[j] = [ctx.recv(p, bv(slot(j, i))) for i, p in enumerate(peers)]

    def send(j: int) -> None:
        if j < nseg:
            sends.extend(ctx.send(p, bv(contribution(p, j))) for p in peers)

    for j in range(depth):
        post(j)
    for j in range(depth):
        send(j)
    for j in range(nseg):
        if hooks is not None:
            hooks[0](j)
        mine = own(j)
        for i, rv in enumerate(recvs.pop(j)):
            await rv
            await reduce_into(op, mine, slot(j, i))
        await finalize(op, mine, n)
        if hooks is not None:
            hooks[1](j)
        post(j + depth)  # into the slots segment j has just freed
        send(j + depth)
    await wait_all(sends)
