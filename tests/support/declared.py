"""Operations declared by a test, through the operation table only (``aiodist.operations``).

``declare_test_operations(monkeypatch)`` adds, for the test's duration:

- ``sum_all(tensor)``: an operation over an existing kind (an ``all_reduce`` that always sums);
- ``shift(output, input)``: a new kind, ``ring_shift``, planned from ``KINDS`` as steps: each
  rank's ``input`` lands in ``output`` of the next rank (group rank order, wrapping around).

Nothing else of aiodist is touched: a group runs them by name (``group.collective``).
"""

from __future__ import annotations

from typing import Any

import pytest

from aiodist import operations
from aiodist.backends.base import IN, INOUT, OUT, Binding, Op
from aiodist.collectives.context import OpContext, byte_view
from aiodist.collectives.steps import Steps
from aiodist.errors import DistValueError
from aiodist.ops import ReduceOp, dtype_name

__all__ = ["declare_test_operations"]


def _sum_all(g: operations.Members, b: Binding, tensor: Any) -> operations.Checked:
    arr = b.tensor(tensor, arg="tensor", role=INOUT, writable=True)
    op = Op("all_reduce", (arr,), reduce_op=ReduceOp.SUM)
    return operations.Checked(op, dtype_name(arr.dtype), arr.size)


def _shift(g: operations.Members, b: Binding, output: Any, input: Any) -> operations.Checked:
    out = b.tensor(output, arg="output", role=OUT, writable=True)
    inp = b.tensor(input, arg="input", role=IN, writable=False)
    if out.dtype != inp.dtype or out.size != inp.size:
        raise DistValueError("shift: output and input must have the same dtype and size")
    return operations.Checked(Op("ring_shift", (out,), (inp,)), dtype_name(inp.dtype), inp.size)


def _ring_shift(ctx: OpContext, op: Op) -> Steps:
    right, left = (ctx.rank + 1) % ctx.size, (ctx.rank - 1) % ctx.size
    yield (ctx.send(right, byte_view(op.inputs[0])), ctx.recv(left, byte_view(op.outputs[0])))


def declare_test_operations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Declare ``sum_all`` and ``shift`` (and the kind ``ring_shift``) until the test ends."""
    monkeypatch.setitem(operations.KINDS, "ring_shift", operations.Kind(_ring_shift))
    for name, check, tensors in (("sum_all", _sum_all, 1), ("shift", _shift, 2)):
        monkeypatch.setitem(operations.TABLE, name, operations.Operation(name, check, name, tensors, None))
