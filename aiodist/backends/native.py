"""``NativeBackend``: aiodist's own algorithms over the group's transport.

A tensor's own memory is what the algorithms read and write (``aiodist._tensors.as_array``:
a flat numpy view of a numpy array or CPU torch tensor; a device tensor is refused with
``DeviceTensorError`` unless a ``StagedBackend`` wraps this one). ``algorithm`` is the one
place that picks the algorithm of a collective: the host-aware forms
(``aiodist.collectives.hostaware``: direct over shared memory on one host, hierarchical with
leaders across hosts) where ``select.host_algorithm`` calls for them, the flat dispatchers
(each picks its variant by size) otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from aiodist import _tensors
from aiodist.backends.base import Array, Binding, BoundGroup, Gate, Op, Role, TensorOps
from aiodist.collectives import hostaware, select
from aiodist.collectives.allgather import allgather, bruck_allgather_steps, check_allgather
from aiodist.collectives.allreduce import allreduce, recursive_doubling_steps
from aiodist.collectives.alltoall import alltoall
from aiodist.collectives.barrier import barrier, barrier_steps
from aiodist.collectives.broadcast import broadcast, tree_broadcast_steps
from aiodist.collectives.context import OpContext
from aiodist.collectives.direct import direct_allgather_steps, direct_broadcast_steps
from aiodist.collectives.gather import gather, scatter
from aiodist.collectives.hierarchical import note
from aiodist.collectives.reduce import reduce, tree_reduce_steps
from aiodist.collectives.reduce_scatter import reduce_scatter
from aiodist.collectives.steps import Steps
from aiodist.ops import ReduceOp
from aiodist.work import Work

__all__ = ["NATIVE", "NativeBackend", "algorithm", "stepped"]


def _host_bytes(ctx: OpContext, op: Op) -> int:
    """The size ``select.host_algorithm`` weighs for ``op`` (-1: an operation with no host-aware form)."""
    match op.kind:
        case "barrier":
            return 0
        case "broadcast" | "all_reduce" | "reduce":
            return int(op.outputs[0].nbytes)
        case "all_gather":  # (the largest block: equal on every rank, as blocks may differ in size)
            return max(int(b.nbytes) for b in op.outputs)
        case "reduce_scatter":
            return int(op.outputs[0].nbytes) * ctx.size
        case _:
            return -1


def algorithm(ctx: OpContext, op: Op) -> Coroutine[Any, Any, None]:
    """The algorithm that runs ``op`` on this rank: a host-aware form where the group's layout over
    hosts calls for one (``select.host_algorithm``), else the flat one (which picks its variant by
    size: ``select``)."""
    out, inp, rop = op.outputs, op.inputs, op.reduce_op or ReduceOp.SUM
    nbytes = _host_bytes(ctx, op)
    how = select.host_algorithm(op.kind, nbytes, ctx) if nbytes >= 0 else "flat"
    if how != "flat":
        match op.kind:
            case "barrier":
                return hostaware.barrier(ctx, how)
            case "broadcast":
                return hostaware.broadcast(ctx, out[0], op.root, how)
            case "all_reduce":
                return hostaware.allreduce(ctx, out[0], rop, how)
            case "reduce":
                return hostaware.reduce(ctx, out[0], rop, op.root, how)
            case "all_gather":
                return hostaware.allgather(ctx, list(out), inp[0], how)
            case "reduce_scatter":
                return hostaware.reduce_scatter(ctx, out[0], list(inp), rop, how)
    match op.kind:
        case "barrier":
            return barrier(ctx)
        case "broadcast":
            return broadcast(ctx, out[0], op.root)
        case "all_reduce":
            return allreduce(ctx, out[0], rop)
        case "reduce":
            return reduce(ctx, out[0], rop, op.root)
        case "all_gather":
            return allgather(ctx, list(out), inp[0])
        case "gather":
            return gather(ctx, inp[0], list(out) if out else None, op.root)
        case "scatter":
            return scatter(ctx, out[0], list(inp) if inp else None, op.root)
        case "reduce_scatter":
            return reduce_scatter(ctx, out[0], list(inp), rop)
        case "all_to_all":
            return alltoall(ctx, list(out), list(inp))


def stepped(ctx: OpContext, op: Op) -> Steps | None:
    """The steps of ``op`` where the algorithm ``algorithm`` would pick is written as steps (the
    small and one-host forms: flat barrier, recursive doubling, binomial trees, direct broadcast
    and all_gather): it then runs advanced by its arrivals, with no task (see
    ``aiodist.collectives.steps``). None: ``algorithm`` runs it as a task."""
    n = ctx.size
    if n == 1:
        return None
    out, inp = op.outputs, op.inputs
    nbytes = _host_bytes(ctx, op)
    how = select.host_algorithm(op.kind, nbytes, ctx) if nbytes >= 0 else "flat"
    match op.kind, how:
        case "barrier", "flat":
            return barrier_steps(ctx)
        case "all_reduce", "flat" if select.allreduce_algorithm(nbytes, n) != "ring":
            return recursive_doubling_steps(ctx, out[0], op.reduce_op or ReduceOp.SUM)
        case "broadcast", "flat" if select.broadcast_algorithm(nbytes, n) == "tree":
            return tree_broadcast_steps(ctx, out[0], op.root)
        case "broadcast", "direct":
            note(ctx, "broadcast", how)
            return direct_broadcast_steps(ctx, out[0], op.root)
        case "reduce", "flat" if select.reduce_algorithm(nbytes, n) == "tree":
            return tree_reduce_steps(ctx, out[0], op.reduce_op or ReduceOp.SUM, op.root)
        case "all_gather", "direct":
            note(ctx, "all_gather", how)
            return _allgather_steps(ctx, list(out), inp[0], direct_allgather_steps)
        case "all_gather", "flat" if all(b.size == inp[0].size for b in out) and (
            select.allgather_algorithm(int(inp[0].nbytes), n) == "bruck"
        ):
            return _allgather_steps(ctx, list(out), inp[0], bruck_allgather_steps)
    return None


def _allgather_steps(
    ctx: OpContext,
    blocks: list[Array],
    inp: Array,
    steps: Callable[[OpContext, list[Array], Array], Steps],
) -> Steps:
    check_allgather(ctx, blocks, inp)  # (in the first step: a failure is the operation's, as in a task)
    yield from steps(ctx, blocks, inp)


async def _gated(gate: Gate, coro: Coroutine[Any, Any, None]) -> None:
    try:
        await gate()
    except BaseException:
        coro.close()
        raise
    await coro


class _NativeBinding:
    __slots__ = ("group",)

    def __init__(self, group: BoundGroup) -> None:
        self.group = group

    def tensor(self, obj: Any, *, arg: str, role: Role, writable: bool) -> Array:
        return _tensors.as_array(obj, arg=arg, writable=writable)

    def ready_now(self) -> None:
        pass

    def start(self, ctx: OpContext, op: Op, timeout: float | None, gate: Gate | None = None) -> Work:
        if gate is None and (steps := stepped(ctx, op)) is not None:
            return self.group.run_steps(ctx, steps, timeout)
        coro = algorithm(ctx, op)
        return self.group.track_collective(ctx, coro if gate is None else _gated(gate, coro), timeout)

    def complete(self, work: Work) -> Work:
        return work

    def drop(self) -> None:
        pass


class NativeBackend:
    """aiodist's algorithms over the group's transport (backend names "tcp" and "gloo")."""

    own_ops: TensorOps | None = None

    def __repr__(self) -> str:
        return "<NativeBackend>"

    def bind(self, group: BoundGroup, what: str) -> Binding:
        return _NativeBinding(group)

    def direct(self, obj: Any) -> bool:
        return True

    async def aclose(self) -> None:
        pass


#: The native backend holds no state: every group may share this one.
NATIVE = NativeBackend()
