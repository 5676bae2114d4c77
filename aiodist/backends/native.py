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

from collections.abc import Coroutine
from typing import Any, cast

from aiodist import _tensors
from aiodist.backends.base import Array, Binding, BoundGroup, Gate, Op, Role, TensorOps
from aiodist.collectives import hostaware, select
from aiodist.collectives.allgather import allgather
from aiodist.collectives.allreduce import allreduce
from aiodist.collectives.alltoall import alltoall
from aiodist.collectives.barrier import barrier_steps
from aiodist.collectives.broadcast import broadcast
from aiodist.collectives.context import OpContext
from aiodist.collectives.gather import gather, scatter
from aiodist.collectives.reduce import reduce
from aiodist.collectives.reduce_scatter import reduce_scatter
from aiodist.collectives.steps import Plan, Steps, is_steps, run
from aiodist.ops import ReduceOp
from aiodist.work import Work

__all__ = ["NATIVE", "NativeBackend", "algorithm"]


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


def algorithm(ctx: OpContext, op: Op) -> Plan:
    """The plan of ``op`` on this rank (``aiodist.collectives.steps``): a host-aware form where
    the group's layout over hosts calls for one (``select.host_algorithm``), else the flat one
    (whose dispatcher picks its variant by size: ``select``). Small and one-host forms come as
    steps, advanced by their arrivals with no task; the others as coroutines."""
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
            return barrier_steps(ctx)
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
    raise AssertionError(f"no algorithm for {op.kind!r}")


async def _gated(gate: Gate, plan: Plan) -> None:
    try:
        await gate()
    except BaseException:
        plan.close()
        raise
    await run(plan)


class _NativeBinding:
    __slots__ = ("group",)

    def __init__(self, group: BoundGroup) -> None:
        self.group = group

    def tensor(self, obj: Any, *, arg: str, role: Role, writable: bool) -> Array:
        return _tensors.as_array(obj, arg=arg, writable=writable)

    def ready_now(self) -> None:
        pass

    def start(self, ctx: OpContext, op: Op, timeout: float | None, gate: Gate | None = None) -> Work:
        plan = algorithm(ctx, op)
        if gate is not None:
            return self.group.track_collective(ctx, _gated(gate, plan), timeout)
        if is_steps(plan):
            return self.group.run_steps(ctx, cast(Steps, plan), timeout)
        return self.group.track_collective(ctx, cast("Coroutine[Any, Any, None]", plan), timeout)

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
