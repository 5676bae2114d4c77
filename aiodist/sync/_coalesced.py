"""torch's ``all_reduce_coalesced`` and ``all_gather_coalesced`` (deprecated in torch, still used).

Each is one collective of the existing kind over a flat buffer holding every tensor of the list
end to end (tensors of different shapes and sizes, all of one dtype): one sequence number, one
fingerprint, one algorithm run. The results are copied back into the caller's tensors before the
Work completes.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

import aiodist.face.tensor_collectives as _c
import aiodist.face.world as _world
from aiodist import _tensors
from aiodist.errors import DistTypeError, DistValueError
from aiodist.ops import ReduceOp, dtype_name
from aiodist.sync._core import check_complex_op, not_in_group
from aiodist.sync._launch import run_op
from aiodist.work import Work

__all__ = ["all_gather_coalesced", "all_reduce_coalesced"]


def _deprecated(name: str, instead: str) -> None:
    warnings.warn(
        f"{name} will be deprecated, as torch's; use {instead} (aiodist runs it as one collective either way)",
        FutureWarning,
        stacklevel=3,
    )


def _same_dtype(arrays: Sequence[Any], arg: str) -> None:
    for i, a in enumerate(arrays):
        if a.dtype != arrays[0].dtype:
            raise DistTypeError(
                f"{arg}: all tensors must have the same dtype; {arg}[0] is {dtype_name(arrays[0].dtype)}, "
                f"{arg}[{i}] is {dtype_name(a.dtype)}"
            )


def _as_list(tensors: Any, arg: str) -> list[Any]:
    if _tensors.is_tensor_like(tensors):
        return [tensors]
    if not isinstance(tensors, list | tuple) or not tensors:
        raise DistTypeError(f"{arg} must be a non-empty list of tensors, got {tensors!r:.80}")
    return list(tensors)


def all_reduce_coalesced(
    tensors: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Work | None:
    """Reduce every tensor of ``tensors`` in place across ``group`` (one collective for all)."""
    _deprecated("all_reduce_coalesced", "all_reduce per tensor")
    tensor_list = _as_list(tensors, "tensors")
    if not_in_group(group, "all_reduce_coalesced"):
        return None
    check_complex_op("all_reduce", op, tensor_list)
    return run_op(  # type: ignore[no-any-return]
        "all_reduce", lambda ts: _start_all_reduce(ts, op, group), async_op, tensor_list
    )


def _real(arrays: list[Any]) -> list[Any]:
    """Complex arrays as their real and imaginary parts, as torch does (``view_as_real``), so
    that complex64 and float32 tensors travel in one buffer."""
    return [a.view(a.real.dtype) if np.iscomplexobj(a) else a for a in arrays]


def _start_all_reduce(tensors: list[Any], op: Any, group: Any) -> Work:
    arrays = _real(_tensors.as_arrays(tensors, arg="tensors", writable=True))
    _same_dtype(arrays, "tensors")
    flat = np.concatenate(arrays)
    inner = _c.all_reduce(flat, op, group)
    return Work(asyncio.get_running_loop().create_task(_scatter_back(inner, flat, [arrays])), inner.name)


def all_gather_coalesced(
    output_tensor_lists: Any, input_tensor_list: Any, group: Any = None, async_op: bool = False
) -> Work | None:
    """``output_tensor_lists[r][i]`` receives member ``r``'s ``input_tensor_list[i]`` (one collective)."""
    _deprecated("all_gather_coalesced", "all_gather_into_tensor")
    inputs = _as_list(input_tensor_list, "input_tensor_list")
    if not isinstance(output_tensor_lists, list | tuple) or not all(
        isinstance(o, list | tuple) for o in output_tensor_lists
    ):
        raise DistTypeError(
            "output_tensor_lists must be a list of lists of tensors, one list per group member"
        )
    if not_in_group(group, "all_gather_coalesced"):
        return None
    return run_op(  # type: ignore[no-any-return]
        "all_gather",
        lambda outs, ins: _start_all_gather(outs, ins, group),
        async_op,
        [list(o) for o in output_tensor_lists],
        inputs,
        inputs=1,
    )


def _start_all_gather(outputs: list[list[Any]], inputs: list[Any], group: Any) -> Work:
    size = _world.resolve_group(group).size
    if len(outputs) != size:
        raise DistValueError(
            f"output_tensor_lists must have one list per group member ({size}), got {len(outputs)}"
        )
    ins = _real(_tensors.as_arrays(inputs, arg="input_tensor_list", writable=False))
    _same_dtype(ins, "input_tensor_list")
    outs = []
    for r, row in enumerate(outputs):
        arrs = _real(_tensors.as_arrays(row, arg=f"output_tensor_lists[{r}]", writable=True))
        if [a.size for a in arrs] != [a.size for a in ins] or any(a.dtype != ins[0].dtype for a in arrs):
            raise DistValueError(
                f"output_tensor_lists[{r}] must hold tensors of the sizes and dtype of input_tensor_list "
                f"({[a.size for a in ins]} {dtype_name(ins[0].dtype)}), got {[a.size for a in arrs]}"
            )
        outs.append(arrs)
    flat_in = np.concatenate(ins)
    flat_out = np.empty(flat_in.size * size, dtype=flat_in.dtype)
    inner = _c.all_gather_into_tensor(flat_out, flat_in, group)
    return Work(asyncio.get_running_loop().create_task(_scatter_back(inner, flat_out, outs)), inner.name)


async def _scatter_back(inner: Work, flat: Any, rows: list[list[Any]]) -> None:
    """Once ``inner`` is done, copy ``flat`` (the rows end to end) into the arrays of ``rows``."""
    await inner
    start = 0
    for row in rows:
        for a in row:
            a[...] = flat[start : start + a.size]
            start += a.size
