"""reduce_scatter: direct exchange for small inputs, a segmented pipelined ring for large ones.

Rank r ends with block r of the element-wise reduction of every rank's input blocks; the
inputs are only read.

Direct (small): every rank sends input block j to rank j and receives block r from all the
others into a staging buffer, then folds the contributions in rank order 0, 1, ..., n-1
(one round; a fixed order, so floating-point results do not depend on arrival order).

Ring (large): the mirror of all_reduce's first half. Blocks are cut into S segments; for
each segment j, in step t rank r receives from the left the partial reduction of block
r - t - 2 into a scratch slot, folds its own input block into it (numpy ``out=``) and passes
it right; the last step brings block r itself, received straight into the output and
finished there. The S rings run as one pipeline, diagonal by diagonal
(``_common.diagonal_order``), so receiving, reducing (in a worker thread when large) and
sending overlap. Every rank sends and receives (n-1)/n of its input. Scratch:
``select.RING_SLOTS`` segments; a slot is reused once the send out of it has completed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Any

import numpy as np

from aiodist.collectives import select
from aiodist.collectives._common import (
    Array,
    bounds,
    bv,
    check_size,
    copy_into,
    diagonal_order,
    finalize,
    n_segments,
    reduce_into,
    wait_all,
)
from aiodist.collectives.context import OpContext
from aiodist.ops import ReduceOp

__all__ = ["direct_reduce_scatter", "reduce_scatter", "ring_reduce_scatter"]


async def reduce_scatter(ctx: OpContext, out: Array, blocks: Sequence[Array], op: ReduceOp) -> None:
    """``out`` = the reduction over ranks of their ``blocks[rank]`` (all blocks ``out``'s size)."""
    n = ctx.size
    check_size("reduce_scatter input list length", len(blocks), n)
    for b in blocks:
        check_size("reduce_scatter input block", b.size, out.size)
    if n == 1:
        copy_into(out, blocks[0])
        await finalize(op, out, 1)
        return
    if select.reduce_scatter_algorithm(out.nbytes, n) == "ring":
        await ring_reduce_scatter(ctx, out, blocks, op)
    else:
        await direct_reduce_scatter(ctx, out, blocks, op)


async def direct_reduce_scatter(ctx: OpContext, out: Array, blocks: Sequence[Array], op: ReduceOp) -> None:
    n, r = ctx.size, ctx.rank
    b = out.size
    staging = np.empty((n - 1) * b, dtype=out.dtype)
    parts = {}
    recvs = []
    for k, src in enumerate(i for i in range(n) if i != r):
        parts[src] = staging[k * b : (k + 1) * b]
        recvs.append(ctx.recv(src, bv(parts[src])))
    parts[r] = blocks[r]
    sends = [ctx.send((r + k) % n, bv(blocks[(r + k) % n])) for k in range(1, n)]
    await wait_all(recvs)
    copy_into(out, parts[0])
    for src in range(1, n):
        await reduce_into(op, out, parts[src])
    await finalize(op, out, n)
    await wait_all(sends)


async def ring_reduce_scatter(ctx: OpContext, out: Array, blocks: Sequence[Array], op: ReduceOp) -> None:
    n, r = ctx.size, ctx.rank
    right, left = (r + 1) % n, (r - 1) % n
    seg = select.segment_elems(out.itemsize)
    nseg = n_segments(out.size, seg)
    sb = bounds(out.size, nseg)
    steps = n - 1

    def part(a: Array, j: int) -> Array:
        return a[sb[j] : sb[j + 1]]

    order = diagonal_order(nseg, steps)
    nslots = select.RING_SLOTS
    slot_len = min(seg, max(1, out.size))
    scratch = np.empty(nslots * slot_len, dtype=out.dtype)
    slots = [scratch[k * slot_len : (k + 1) * slot_len] for k in range(nslots)]
    free_slots = list(range(nslots))
    slot_of: dict[int, int] = {}
    slot_send: dict[int, Awaitable[None]] = {}  # slot -> the send out of it
    posted: dict[int, Awaitable[Any]] = {}
    sends: list[Awaitable[None]] = []
    next_post = 0

    async def post_next() -> None:
        """Post the next receive of the schedule, waiting for a slot if it needs one."""
        nonlocal next_post
        j, t = order[next_post]
        if t == steps - 1:
            dest = part(out, j)  # the finished block lands in the output
        else:
            k = free_slots.pop(0)
            pending = slot_send.pop(k, None)
            if pending is not None:
                await pending
            slot_of[next_post] = k
            dest = slots[k][: sb[j + 1] - sb[j]]
        posted[next_post] = ctx.recv(left, bv(dest))
        next_post += 1

    def can_post() -> bool:
        if next_post >= len(order):
            return False
        if order[next_post][1] == steps - 1:
            return True
        return bool(free_slots) and (free_slots[0] not in slot_send or _done(slot_send[free_slots[0]]))

    while can_post():
        await post_next()
    i = 0
    for d in range(nseg + steps - 1):
        if d < nseg:
            sends.append(ctx.send(right, bv(part(blocks[(r - 1) % n], d))))  # step 0: our input
        while i < len(order) and sum(order[i]) == d:
            j, t = order[i]
            if next_post <= i:
                await post_next()
            await posted.pop(i)
            if t == steps - 1:
                mine = part(out, j)
                await reduce_into(op, mine, part(blocks[r], j))
                await finalize(op, mine, n)
            else:
                k = slot_of.pop(i)
                acc = slots[k][: sb[j + 1] - sb[j]]
                await reduce_into(op, acc, part(blocks[(r - t - 2) % n], j))
                slot_send[k] = ctx.send(right, bv(acc))  # step t + 1 of segment j
                free_slots.append(k)
            i += 1
            while can_post():
                await post_next()
    await wait_all(sends)
    await wait_all(slot_send.values())


def _done(aw: Awaitable[None]) -> bool:
    done = getattr(aw, "done", None)
    return bool(done()) if callable(done) else False
