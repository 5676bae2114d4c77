"""gather and scatter: binomial tree for small blocks with 3+ ranks, direct otherwise.

Ranks are numbered relative to the root (v = (r - root) mod n); the subtree of v is the
contiguous range v .. v + lowbit(v) - 1 (the root's is everything).

Gather, tree: each rank collects its subtree's blocks, in relative order, into a staging
buffer (its own block first, then each child's subtree behind it, smallest child first) and
sends the lot to its parent v - lowbit(v): ceil(log2 n) rounds instead of n - 1 messages
converging on the root. Direct: every rank sends its block to the root, which has posted a
receive straight into each output; no copies, the right choice once blocks are large.

Scatter is the mirror image: the tree hands each child the slice of the staging buffer that
covers its subtree; direct sends each block from the root's list without a copy.
Blocks may differ in size (object scatter/gather); then the direct form runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from aiodist.collectives import select
from aiodist.collectives._common import Array, bv, check_size, copy_into, wait_all
from aiodist.collectives.context import OpContext

__all__ = ["gather", "scatter"]


def _lowbit(v: int, n: int) -> int:
    """Size of the subtree rooted at relative rank v (n for the root)."""
    return min(v & -v, n - v) if v else n


def _use_tree(ctx: OpContext, block_bytes: int, equal: bool) -> bool:
    return equal and select.gather_algorithm(block_bytes, ctx.size) == "tree"


async def gather(
    ctx: OpContext, inp: Array, blocks: Sequence[Array] | None, root: int, *, uniform: bool = True
) -> None:
    """Collect every rank's ``inp`` into the root's ``blocks[i]`` (``blocks`` only on the root).

    ``uniform`` says every rank's block has the same size (all ranks must agree; the tree
    form needs it). The root's own block is copied locally.
    """
    n, r = ctx.size, ctx.rank
    if r == root:
        assert blocks is not None
        check_size("gather list length", len(blocks), n)
        check_size("gather own block", blocks[r].size, inp.size)
    if n == 1:
        assert blocks is not None
        copy_into(blocks[0], inp)
        return
    if not _use_tree(ctx, inp.nbytes, uniform):
        if r != root:
            await ctx.send(root, bv(inp))
            return
        assert blocks is not None
        recvs = [ctx.recv(i, bv(blocks[i])) for i in range(n) if i != r]
        copy_into(blocks[r], inp)
        await wait_all(recvs)
        return
    v = (r - root) % n
    b = inp.size
    tmp = np.empty(_lowbit(v, n) * b, dtype=inp.dtype)
    tmp[:b] = inp
    mask = 1
    while mask < n:
        if v & mask:
            await ctx.send((v - mask + root) % n, bv(tmp))
            return
        child = v + mask
        if child < n:
            got = _lowbit(child, n)
            await ctx.recv((child + root) % n, bv(tmp[mask * b : (mask + got) * b]))
        mask <<= 1
    assert blocks is not None
    for i in range(n):
        copy_into(blocks[(i + root) % n], tmp[i * b : (i + 1) * b])


async def scatter(
    ctx: OpContext, out: Array, blocks: Sequence[Array] | None, root: int, *, uniform: bool = True
) -> None:
    """Send the root's ``blocks[i]`` to group rank i's ``out`` (``blocks`` only on the root)."""
    n, r = ctx.size, ctx.rank
    if r == root:
        assert blocks is not None
        check_size("scatter list length", len(blocks), n)
        check_size("scatter own block", blocks[r].size, out.size)
    if n == 1:
        assert blocks is not None
        copy_into(out, blocks[0])
        return
    if not _use_tree(ctx, out.nbytes, uniform):
        if r != root:
            await ctx.recv(root, bv(out))
            return
        assert blocks is not None
        sends = [ctx.send(i, bv(blocks[i])) for i in range(n) if i != r]
        copy_into(out, blocks[r])
        await wait_all(sends)
        return
    v = (r - root) % n
    b = out.size
    size = _lowbit(v, n)
    if v == 0:
        assert blocks is not None
        tmp = np.concatenate([blocks[(i + root) % n] for i in range(n)]) if b else np.empty(0, out.dtype)
        top = 1 << max(0, (n - 1).bit_length() - 1)
    else:
        tmp = np.empty(size * b, dtype=out.dtype)
        await ctx.recv((v - (v & -v) + root) % n, bv(tmp))
        top = (v & -v) >> 1
    sends = []
    mask = top
    while mask > 0:
        child = v + mask
        if child < n:
            got = _lowbit(child, n)
            sends.append(ctx.send((child + root) % n, bv(tmp[mask * b : (mask + got) * b])))
        mask >>= 1
    out[:] = tmp[:b]
    await wait_all(sends)
