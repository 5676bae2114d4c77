"""The host-aware forms of the collectives: which one runs, and a note of it.

``aiodist.backends.native.algorithm`` (the one place a collective's algorithm is picked) hands
an operation here, with the form to run, when ``select.host_algorithm`` says its group's layout
over hosts calls for the direct (one host, ``aiodist.collectives.direct``) or the hierarchical (several hosts,
``aiodist.collectives.hierarchical``) form. Each choice is logged at DEBUG level on the
``aiodist`` logger ("hierarchical", "host-ordered" for a large buffer's ring or chain with the
ranks in host order, "direct"), "two-level", the phases of a hierarchical operation too ("rank 2: all_reduce #7:
all_reduce hierarchical over 2 hosts (4 ranks)", then "rank 2: all_reduce #7: broadcast direct
on one host (2 ranks)"), which is how one sees which path a job took.
"""

from __future__ import annotations

from collections.abc import Sequence

from aiodist.collectives import direct, hierarchical, select
from aiodist.collectives._common import Array
from aiodist.collectives.allgather import check_allgather
from aiodist.collectives.context import OpContext
from aiodist.ops import ReduceOp

__all__ = ["allgather", "allreduce", "barrier", "broadcast", "reduce", "reduce_scatter"]

HOST_ORDERED = hierarchical.HOST_ORDERED
_note = hierarchical.note


async def allreduce(ctx: OpContext, arr: Array, op: ReduceOp, how: str) -> None:
    if how == select.TWO_LEVEL:
        _note(ctx, "all_reduce", how)
        await hierarchical.two_level_allreduce(ctx, arr, op)
    elif how == "direct":
        _note(ctx, "all_reduce", how)
        await direct.direct_allreduce(ctx, arr, op)
    elif select.allreduce_algorithm(arr.nbytes, ctx.size) == "ring":
        _note(ctx, "all_reduce", HOST_ORDERED)
        await hierarchical.host_ordered_allreduce(ctx, arr, op)
    else:
        _note(ctx, "all_reduce", how)
        await hierarchical.hierarchical_allreduce(ctx, arr, op)


async def broadcast(ctx: OpContext, arr: Array, root: int, how: str) -> None:
    if how == "direct":
        _note(ctx, "broadcast", how)
        await direct.direct_broadcast(ctx, arr, root)
    elif select.broadcast_algorithm(arr.nbytes, ctx.size) == "chain":
        _note(ctx, "broadcast", HOST_ORDERED)
        await hierarchical.host_ordered_broadcast(ctx, arr, root)
    else:
        _note(ctx, "broadcast", how)
        await hierarchical.hierarchical_broadcast(ctx, arr, root)


async def allgather(ctx: OpContext, blocks: Sequence[Array], inp: Array, how: str) -> None:
    check_allgather(ctx, blocks, inp)
    if how == "direct":
        _note(ctx, "all_gather", how)
        await direct.direct_allgather(ctx, blocks, inp)
    elif how == select.TWO_LEVEL and all(b.size == inp.size for b in blocks):
        _note(ctx, "all_gather", how)
        await hierarchical.two_level_allgather(ctx, blocks, inp)
    # Blocks may differ in size (all_gather_object): choose by what is equal on every rank.
    # (Two levels were chosen from the ring's switch point, so blocks of different sizes ring.)
    elif select.allgather_algorithm(max(b.nbytes for b in blocks), ctx.size) == "ring":
        _note(ctx, "all_gather", HOST_ORDERED)
        await hierarchical.host_ordered_allgather(ctx, blocks, inp)
    else:
        _note(ctx, "all_gather", how)
        await hierarchical.hierarchical_allgather(ctx, blocks, inp)


async def reduce_scatter(ctx: OpContext, out: Array, blocks: Sequence[Array], op: ReduceOp, how: str) -> None:
    _note(ctx, "reduce_scatter", how)
    if how == select.TWO_LEVEL:
        await hierarchical.two_level_reduce_scatter(ctx, out, blocks, op)
    else:
        await direct.direct_reduce_scatter(ctx, out, blocks, op)


async def reduce(ctx: OpContext, arr: Array, op: ReduceOp, root: int, how: str) -> None:
    if select.reduce_algorithm(arr.nbytes, ctx.size) == "chain":
        _note(ctx, "reduce", HOST_ORDERED)
        await hierarchical.host_ordered_reduce(ctx, arr, op, root)
    else:
        _note(ctx, "reduce", how)
        await hierarchical.hierarchical_reduce(ctx, arr, op, root)


async def barrier(ctx: OpContext, how: str) -> None:
    _note(ctx, "barrier", how)
    await hierarchical.hierarchical_barrier(ctx)
