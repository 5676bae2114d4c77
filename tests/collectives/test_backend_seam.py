"""The seam between a group and its backend: what the group hands a backend it was created
with (the checked, numbered operation as data; each tensor with its role), and that a refused
call gives back what its binding took and leaves the group's numbering untouched."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from support.worlds import backend_world

import aiodist as dist
from aiodist.backends.base import IN, INOUT, OUT, Binding, Gate, Op, Role, TensorOps
from aiodist.backends.native import NATIVE
from aiodist.collectives.context import OpContext
from aiodist.group import ProcessGroup
from aiodist.work import Work

pytestmark = pytest.mark.timeout(60)


class Recording:
    """A backend that runs on the native one and records what the group hands it."""

    own_ops: TensorOps | None = None

    def __init__(self) -> None:
        self.started: list[tuple[Any, Op]] = []
        self.tensors: list[tuple[str, Role, bool]] = []
        self.dropped = 0

    def bind(self, group: ProcessGroup, what: str) -> Binding:
        return _RecordingBinding(self, NATIVE.bind(group, what))

    def direct(self, obj: Any) -> bool:
        return True

    async def aclose(self) -> None:
        pass


class _RecordingBinding:
    def __init__(self, owner: Recording, inner: Binding) -> None:
        self.owner, self.inner = owner, inner

    def tensor(self, obj: Any, *, arg: str, role: Role, writable: bool) -> Any:
        self.owner.tensors.append((arg, role, writable))
        return self.inner.tensor(obj, arg=arg, role=role, writable=writable)

    def ready_now(self) -> None:
        self.inner.ready_now()

    def start(self, ctx: OpContext, op: Op, timeout: float | None, gate: Gate | None = None) -> Work:
        self.owner.started.append((list(ctx.fp or []), op))
        return self.inner.start(ctx, op, timeout, gate)

    def complete(self, work: Work) -> Work:
        return self.inner.complete(work)

    def drop(self) -> None:
        self.owner.dropped += 1
        self.inner.drop()


async def test_the_group_hands_its_backend_the_checked_numbered_operation() -> None:
    backends = [Recording(), Recording()]
    fabric, groups = backend_world(backends)
    try:

        async def run(g: ProcessGroup) -> list[Any]:
            t = np.full(4, float(g.rank + 1), np.float32)
            out = np.zeros(8, np.float32)
            await dist.broadcast(t, 1, group=g)
            await dist.all_reduce(t, dist.ReduceOp.MAX, group=g)
            await dist.all_gather_into_tensor(out, t, group=g)
            return [t.tolist(), out.tolist()]

        res = await asyncio.wait_for(asyncio.gather(*(run(g) for g in groups)), 30)
        assert res == [[[2.0] * 4, [2.0] * 8]] * 2
        for g, b in zip(groups, backends, strict=True):
            fps = [fp for fp, _ in b.started]
            # (the last item: the task that started it, named alike on every rank)
            origin = "test_the_group_hands_its_backend_the_checked_numbered_operation.run"
            assert fps == [
                ["broadcast", 0, "float32", 4, 1, None, origin],
                ["all_reduce", 1, "float32", 4, -1, "MAX", origin],
                ["all_gather_into_tensor", 2, "float32", 4, -1, None, origin],
            ]
            ops = [op for _, op in b.started]
            assert [op.kind for op in ops] == ["broadcast", "all_reduce", "all_gather"]
            assert ops[0].root == 1 and ops[1].reduce_op is dist.ReduceOp.MAX
            assert [a.size for a in ops[2].outputs] == [4, 4]  # the output cut into one block per member
            # Each tensor with its role; the broadcast's source does not need to write its tensor.
            assert b.tensors[0] == ("tensor", INOUT, g.rank != 1)
            assert b.tensors[2:] == [("input_tensor", IN, False), ("output_tensor", OUT, True)]
    finally:
        for t in fabric.transports:
            t.abort()


async def test_a_refused_call_drops_its_binding_and_takes_no_number() -> None:
    backend = Recording()
    fabric, (g,) = backend_world([backend])
    try:
        with pytest.raises(dist.DistTypeError, match=r"tensor_list\[0\] has dtype float64"):
            dist.all_gather([np.zeros(2)], np.zeros(2, np.float32), group=g)
        assert backend.dropped == 1 and backend.started == []
        await dist.barrier(group=g)
        assert backend.started[0][0][:2] == ["barrier", 0]  # the refused call took no sequence number
    finally:
        fabric.transports[0].abort()
