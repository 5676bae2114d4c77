"""reduce: binomial tree for small buffers, pipelined chain with credits for large ones.

Ranks are numbered relative to the root (v = (r - root) mod n). Only the root's buffer is
written; the other ranks' inputs are left as they were.

Binomial tree (small): in round k, ranks whose bit k is set send their partial result to
v - 2^k and leave; the others receive from v + 2^k (when it exists) and fold it in.
ceil(log2 n) rounds; non-roots work on a private copy of their input.

Pipelined chain (large): the buffer is cut into segments that flow v(n-1) -> ... -> v1 ->
root; each rank receives a segment into one of ``select.RING_SLOTS`` scratch slots, folds
its own data into it and passes it on, and the root folds the incoming segment into its
buffer. Flow control by credits: after freeing a slot a rank posts the next receive into it
and sends an empty credit upstream; a sender sends segment j + slots only after the credit
for segment j, so every segment lands in a posted buffer (no unexpected-message copies) and
the scratch stays at ``slots`` segments whatever the buffer size. Reductions of large
segments run in a worker thread while the next segment arrives.
"""

from __future__ import annotations

from collections.abc import Awaitable

import numpy as np

from aiodist.collectives import select
from aiodist.collectives._common import (
    Array,
    SlotReceives,
    bounds,
    bv,
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

__all__ = ["chain_reduce", "reduce", "tree_reduce_steps"]

_CREDIT = memoryview(b"")


def reduce(ctx: OpContext, arr: Array, op: ReduceOp, root: int) -> Plan:
    """Reduce every rank's ``arr`` into the root's ``arr`` (only the root's is written)."""
    if ctx.size == 1:
        return no_steps()
    if select.reduce_algorithm(arr.nbytes, ctx.size) == "chain":
        return chain_reduce(ctx, arr, op, root)
    return tree_reduce_steps(ctx, arr, op, root)


def tree_reduce_steps(ctx: OpContext, arr: Array, op: ReduceOp, root: int) -> Steps:
    """The binomial tree as steps (``aiodist.collectives.steps``)."""
    n = ctx.size
    v = (ctx.rank - root) % n
    acc = arr if v == 0 else arr.copy()
    tmp = np.empty_like(arr)
    mask = 1
    while mask < n:
        if v & mask:
            yield (ctx.send((v - mask + root) % n, bv(acc)),)
            return
        if v + mask < n:
            yield (ctx.recv((v + mask + root) % n, bv(tmp)),)
            if (w := reduce_soon(op, acc, tmp)) is not None:
                yield (w,)
        mask <<= 1
    if (w := finalize_soon(op, acc, n)) is not None:
        yield (w,)


async def chain_reduce(ctx: OpContext, arr: Array, op: ReduceOp, root: int) -> None:
    n = ctx.size
    v = (ctx.rank - root) % n
    up = (ctx.rank + 1) % n  # sends us data (v + 1)
    down = (ctx.rank - 1) % n  # we send data to it (v - 1)
    seg = select.segment_elems(arr.itemsize)
    nseg = n_segments(arr.size, seg)
    sb = bounds(arr.size, nseg)
    nslots = min(select.RING_SLOTS, nseg)

    def part(a: Array, j: int) -> Array:
        return a[sb[j] : sb[j + 1]]

    sends: list[Awaitable[None]] = []
    # Credits from downstream: segment j may go once the credit for j - nslots arrived.
    credits = [] if v == 0 else [ctx.recv(down, memoryview(bytearray(0))) for _ in range(nseg - nslots)]
    if v == n - 1:  # the far end of the chain only sends
        for j in range(nseg):
            if j >= nslots:
                await credits[j - nslots]
            sends.append(ctx.send(down, bv(part(arr, j))))
        await wait_all(sends)
        return

    def post(j: int, slot: Array | None) -> Awaitable[int]:
        assert slot is not None  # every segment lands in a slot
        fut = ctx.recv(up, bv(slot))
        if j >= nslots:
            sends.append(ctx.send(up, _CREDIT))  # its buffer is posted: upstream may send j
        return fut

    rx = SlotReceives(nslots, min(seg, max(1, arr.size)), arr.dtype, nseg, lambda j: sb[j + 1] - sb[j], post)
    slot_send: dict[int, Awaitable[None]] = {}  # by slot: its data on the way downstream
    for j in range(nseg):
        mine = part(arr, j)
        k = await rx.arrived(j)
        assert k is not None
        incoming = rx.view(k, mine.size)
        if v == 0:
            await reduce_into(op, mine, incoming)
            await finalize(op, mine, n)
        else:
            await reduce_into(op, incoming, mine)  # incoming (op) mine, into the slot
            if j >= nslots:
                await credits[j - nslots]
            slot_send[k] = ctx.send(down, bv(incoming))
        if j + nslots < nseg:
            pending = slot_send.pop(k, None)
            if pending is not None:
                await pending  # the slot is free once its data has left
            rx.release(k)
    await wait_all(slot_send.values())
    await wait_all(sends)
