"""The host-aware forms of the collectives: which one runs, and a note of it.

``aiodist.backends.native.algorithm`` (the one place a collective's algorithm is picked) hands
an operation here, with the form to run, and gets back its plan (``aiodist.collectives.steps``), when ``select.host_algorithm`` says its group's layout
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
from aiodist.collectives.context import OpContext
from aiodist.collectives.steps import Plan
from aiodist.ops import ReduceOp

__all__ = ["allgather", "allreduce", "barrier", "broadcast", "reduce", "reduce_scatter"]

HOST_ORDERED = hierarchical.HOST_ORDERED
_note = hierarchical.note


def allreduce(ctx: OpContext, arr: Array, op: ReduceOp, how: str) -> Plan:
    if how == select.TWO_LEVEL:
        _note(ctx, "all_reduce", how)
        return hierarchical.two_level_allreduce(ctx, arr, op)
    if how == "direct":
        _note(ctx, "all_reduce", how)
        return direct.direct_allreduce(ctx, arr, op)
    if select.allreduce_algorithm(arr.nbytes, ctx.size) == "ring":
        _note(ctx, "all_reduce", HOST_ORDERED)
        return hierarchical.host_ordered_allreduce(ctx, arr, op)
    _note(ctx, "all_reduce", how)
    return hierarchical.hierarchical_allreduce(ctx, arr, op)


def broadcast(ctx: OpContext, arr: Array, root: int, how: str) -> Plan:
    if how == "direct":
        _note(ctx, "broadcast", how)
        return direct.direct_broadcast_steps(ctx, arr, root)
    if select.broadcast_algorithm(arr.nbytes, ctx.size) == "chain":
        _note(ctx, "broadcast", HOST_ORDERED)
        return hierarchical.host_ordered_broadcast(ctx, arr, root)
    _note(ctx, "broadcast", how)
    return hierarchical.hierarchical_broadcast(ctx, arr, root)


def allgather(ctx: OpContext, blocks: Sequence[Array], inp: Array, how: str) -> Plan:
    # (each form checks the blocks first, inside the operation: ``check_allgather``)
    if how == "direct":
        _note(ctx, "all_gather", how)
        return direct.direct_allgather_steps(ctx, blocks, inp)
    if how == select.TWO_LEVEL and all(b.size == inp.size for b in blocks):
        _note(ctx, "all_gather", how)
        return hierarchical.two_level_allgather(ctx, blocks, inp)
    # Blocks may differ in size (all_gather_object): choose by what is equal on every rank.
    # (Two levels were chosen from the ring's switch point, so blocks of different sizes ring.)
    if select.allgather_algorithm(max((b.nbytes for b in blocks), default=0), ctx.size) == "ring":
        _note(ctx, "all_gather", HOST_ORDERED)
        return hierarchical.host_ordered_allgather(ctx, blocks, inp)
    _note(ctx, "all_gather", how)
    return hierarchical.hierarchical_allgather(ctx, blocks, inp)


def reduce_scatter(ctx: OpContext, out: Array, blocks: Sequence[Array], op: ReduceOp, how: str) -> Plan:
    _note(ctx, "reduce_scatter", how)
    if how == select.TWO_LEVEL:
        return hierarchical.two_level_reduce_scatter(ctx, out, blocks, op)
    return direct.direct_reduce_scatter(ctx, out, blocks, op)


def reduce(ctx: OpContext, arr: Array, op: ReduceOp, root: int, how: str) -> Plan:
    if select.reduce_algorithm(arr.nbytes, ctx.size) == "chain":
        _note(ctx, "reduce", HOST_ORDERED)
        return hierarchical.host_ordered_reduce(ctx, arr, op, root)
    _note(ctx, "reduce", how)
    return hierarchical.hierarchical_reduce(ctx, arr, op, root)


def barrier(ctx: OpContext, how: str) -> Plan:
    _note(ctx, "barrier", how)
    return hierarchical.hierarchical_barrier(ctx)
