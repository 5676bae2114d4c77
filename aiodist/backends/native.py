"""``NativeBackend``: aiodist's own algorithms over the group's transport.

A tensor's own memory is what the algorithms read and write (``aiodist._tensors.as_array``:
a flat numpy view of a numpy array or CPU torch tensor; a device tensor is refused with
``DeviceTensorError`` unless a ``StagedBackend`` wraps this one). ``algorithm`` is the one
place that picks the algorithm of a collective, from its kind's entry in the operation table
(``aiodist.operations.KINDS``): the host-aware forms (``aiodist.collectives.hostaware``: direct
over shared memory on one host, hierarchical with leaders across hosts) where
``select.host_algorithm`` calls for them, the flat dispatchers (each picks its variant by size)
otherwise.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, cast

from aiodist import _tensors
from aiodist.backends.base import Array, Binding, BoundGroup, Gate, Op, Role, TensorOps
from aiodist.collectives import select
from aiodist.collectives.context import OpContext
from aiodist.collectives.steps import Plan, Steps, is_steps, run
from aiodist.errors import DistValueError
from aiodist.operations import KINDS
from aiodist.work import Work

__all__ = ["NATIVE", "NativeBackend", "algorithm"]


def algorithm(ctx: OpContext, op: Op) -> Plan:
    """The plan of ``op`` on this rank (``aiodist.collectives.steps``), as its kind's entry in
    the operation table says (``aiodist.operations.KINDS``): a host-aware form where the
    group's layout over hosts calls for one (``select.host_algorithm``), else the flat one
    (whose dispatcher picks its variant by size: ``select``). Small and one-host forms come as
    steps, advanced by their arrivals with no task; the others as coroutines."""
    kind = KINDS.get(op.kind)
    if kind is None:  # (an entry of the table made an Op of a kind it did not declare)
        raise DistValueError(
            f"{op.kind!r} is no kind of collective aiodist plans (see aiodist.operations.KINDS)"
        )
    if kind.host is not None:
        how = select.host_algorithm(op.kind, kind.host_bytes(ctx, op), ctx)
        if how != "flat":
            return kind.host(ctx, op, how)
    return kind.flat(ctx, op)


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
