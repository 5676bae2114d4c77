"""all_reduce: recursive doubling for small buffers, a segmented pipelined ring for large ones.

Recursive doubling (small): with p the largest power of two <= n and e = n - p, ranks
0..2e-1 pair up and each even one hands its data to its odd neighbour, which stands for
both; then p ranks exchange-and-reduce with partner (v XOR 2^k) for k = 0..log2(p)-1;
finally the odd ranks hand the result back. Partners always reduce in the same operand
order (the lower virtual rank's data first), so every rank ends with the same bytes even
where an op is not bitwise commutative (min of -0.0 and +0.0, NaN payloads).
log2(n) rounds, the whole buffer each round: latency-optimal.

Ring (large): the buffer is cut into n chunks and each chunk into S segments. Segment j of
every chunk forms its own ring of 2(n-1) steps: n-1 reduce-scatter steps (receive a
partial sum of chunk c from the left into a scratch slot, reduce it into our own chunk c
with numpy ``out=``, forward it right), after which rank r owns the finished chunk r+1,
then n-1 all-gather steps that pass every owner's finished chunk around, received
straight into the user's buffer. The S rings run as one software pipeline, diagonal by
diagonal (see ``_common.diagonal_order``): while segment j is reduced (in a worker thread
when large), segment j+1 is already arriving and segment j-1 is on its way out. Each chunk
is reduced by exactly one chain of ranks and then copied, so all ranks end with identical
bytes. Bandwidth-optimal: every rank sends and receives 2(n-1)/n of the buffer. Scratch:
``select.RING_SLOTS`` segments.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import numpy as np

from aiodist.collectives import select
from aiodist.collectives._common import (
    Array,
    SlotReceives,
    bounds,
    bv,
    diagonal_order,
    finalize,
    finalize_soon,
    n_segments,
    reduce_into,
    reduce_soon,
    wait_all,
)
from aiodist.collectives.context import OpContext
from aiodist.collectives.steps import Plan, Steps, no_steps
from aiodist.ops import ReduceOp

__all__ = ["allreduce", "recursive_doubling_steps", "ring_allreduce"]


def allreduce(ctx: OpContext, arr: Array, op: ReduceOp) -> Plan:
    """Reduce ``arr`` (flat, writable) across the group in place; every rank gets the result."""
    if ctx.size == 1:
        return no_steps()
    if select.allreduce_algorithm(arr.nbytes, ctx.size) == "ring":
        return ring_allreduce(ctx, arr, op)
    return recursive_doubling_steps(ctx, arr, op)


def recursive_doubling_steps(ctx: OpContext, arr: Array, op: ReduceOp) -> Steps:
    """Recursive doubling (see the module doc) as steps (``aiodist.collectives.steps``)."""
    n, r = ctx.size, ctx.rank
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    acc = arr
    tmp = np.empty_like(arr)
    if r < 2 * extra and r % 2 == 0:
        # Folded into r + 1 for the doubling rounds; gets the result back at the end.
        yield (ctx.send(r + 1, bv(arr)),)
        yield (ctx.recv(r + 1, bv(arr)),)
        return
    if r < 2 * extra:
        yield (ctx.recv(r - 1, bv(tmp)),)
        if (w := reduce_soon(op, tmp, acc)) is not None:  # lower rank's data first
            yield (w,)
        acc, tmp = tmp, acc
        vr = r // 2
    else:
        vr = r - extra
    mask = 1
    while mask < p:
        vpeer = vr ^ mask
        peer = 2 * vpeer + 1 if vpeer < extra else vpeer + extra
        received = ctx.recv(peer, bv(tmp))
        yield (ctx.send(peer, bv(acc)), received)
        if vpeer < vr:
            w = reduce_soon(op, tmp, acc)
            acc, tmp = tmp, acc
        else:
            w = reduce_soon(op, acc, tmp)
        if w is not None:
            yield (w,)
        mask <<= 1
    if (w := finalize_soon(op, acc, n)) is not None:
        yield (w,)
    if acc is not arr:
        np.copyto(arr, acc)
    if r < 2 * extra:
        yield (ctx.send(r - 1, bv(arr)),)


async def ring_allreduce(ctx: OpContext, arr: Array, op: ReduceOp) -> None:
    n, r = ctx.size, ctx.rank
    right, left = (r + 1) % n, (r - 1) % n
    cb = bounds(arr.size, n)
    seg = select.segment_elems(arr.itemsize)
    nseg = n_segments(max(cb[c + 1] - cb[c] for c in range(n)), seg)
    steps = 2 * (n - 1)

    def region(chunk: int, j: int) -> Array:
        lo, hi = cb[chunk], cb[chunk + 1]
        length = hi - lo
        return arr[lo + j * length // nseg : lo + (j + 1) * length // nseg]

    def incoming_chunk(t: int) -> int:
        # Steps 0..n-2 bring partial sums (reduce-scatter), then finished chunks (all-gather).
        return (r - 1 - t) % n if t <= n - 2 else (r - (t - n + 1)) % n

    order = diagonal_order(nseg, steps)
    sends: list[Awaitable[None]] = []

    def scratch_size(i: int) -> int | None:
        j, t = order[i]  # reduce-scatter steps land in scratch; all-gather steps in place
        return region(incoming_chunk(t), j).size if t <= n - 2 else None

    def post(i: int, slot: Array | None) -> Awaitable[Any]:
        j, t = order[i]
        return ctx.recv(left, bv(region(incoming_chunk(t), j) if slot is None else slot))

    rx = SlotReceives(
        select.RING_SLOTS, min(seg, max(1, arr.size)), arr.dtype, len(order), scratch_size, post
    )

    def emit(chunk: int, j: int) -> None:
        sends.append(ctx.send(right, bv(region(chunk, j))))

    i = 0
    for d in range(nseg + steps - 1):
        if d < nseg:
            emit(r, d)  # step 0 of segment d: our own data
        # Process every incoming message of diagonal d (in schedule order).
        while i < len(order) and order[i][0] + order[i][1] == d:
            j, t = order[i]
            chunk = incoming_chunk(t)
            k = await rx.arrived(i)
            if k is not None:
                mine = region(chunk, j)
                await reduce_into(op, mine, rx.view(k, mine.size))
                rx.release(k)
                if t == n - 2:
                    await finalize(op, mine, n)  # the owner's result is what everyone gets
            i += 1
            if t < steps - 1:
                emit(chunk, j)  # step t + 1 of segment j
    await wait_all(sends)
