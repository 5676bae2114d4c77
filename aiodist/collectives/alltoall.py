"""all_to_all: pairwise exchange, even or uneven blocks.

Rank r owes block j of its input to rank j and is owed block r of everyone's. Every receive
is posted at once, straight into its output block (no staging, no copies); the sends then go
out in pairwise order, to r+1, r+2, ..., r+n-1, so that in each "round" every rank sends to
a different peer and no rank is the target of all at once. Sizes may differ per pair; each
receive checks that the sender's block has exactly the expected size (a disagreement is a
CollectiveMismatchError on both sides). This rank's own block is copied locally.
"""

from __future__ import annotations

from collections.abc import Sequence

from aiodist.collectives._common import Array, bv, check_size, copy_into, wait_all
from aiodist.collectives.context import OpContext

__all__ = ["alltoall"]


async def alltoall(ctx: OpContext, out_blocks: Sequence[Array], in_blocks: Sequence[Array]) -> None:
    """``out_blocks[i]`` (this rank) gets rank i's ``in_blocks[this rank]``."""
    n, r = ctx.size, ctx.rank
    check_size("all_to_all output list length", len(out_blocks), n)
    check_size("all_to_all input list length", len(in_blocks), n)
    check_size("all_to_all own block", out_blocks[r].size, in_blocks[r].size)
    recvs = [ctx.recv((r - k) % n, bv(out_blocks[(r - k) % n])) for k in range(1, n)]
    sends = [ctx.send((r + k) % n, bv(in_blocks[(r + k) % n])) for k in range(1, n)]
    copy_into(out_blocks[r], in_blocks[r])
    await wait_all(recvs)
    await wait_all(sends)
