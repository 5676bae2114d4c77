"""``all_reduce`` of a sparse COO tensor, as gloo supports it: the sum, coalesced.

Written over the dense collectives, blocking, in the caller's thread (not the runtime loop's):
every member's non-zero count and shape travel first (one ``all_gather``), then its indices and
values, each padded to the largest count (two more). Each member then builds the same sparse
tensor from all of them, coalesces it (duplicate indices summed) and copies it into the caller's
tensor. The sync face and the torch backend both run it.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

import aiodist.face.tensor_collectives as _c
import aiodist.face.world as _world
from aiodist import _tensors
from aiodist import work as _work
from aiodist.backends.staged import on_caller_stream
from aiodist.errors import DistError, DistValueError
from aiodist.ops import ReduceOp, as_reduce_op
from aiodist.runtime.loop_thread import get_loop_thread
from aiodist.work import Work

__all__ = ["is_sparse", "sparse_all_reduce"]

_MAX_DIMS = 16  # shape entries sent with the count (torch tensors have at most 64; sparse use far fewer)


def is_sparse(obj: Any) -> bool:
    """True for a torch sparse COO tensor."""
    return _tensors.is_torch_tensor(obj) and obj.layout is sys.modules["torch"].sparse_coo


def _blocking(start: Callable[[], Work]) -> None:
    """Start ``start()`` on the runtime loop's thread and wait for the operation to finish."""
    start = on_caller_stream(start)  # torch's current CUDA stream is per thread: carry the caller's over
    try:
        get_loop_thread().call_until_done(lambda: _work.future_of(start()))
    except asyncio.CancelledError:
        raise DistError("the operation was cancelled") from None


def _gather(local: np.ndarray, group: Any, size: int) -> np.ndarray:
    out = np.empty((size, *local.shape), dtype=local.dtype)
    _blocking(lambda: _c.all_gather_into_tensor(out, local, group))
    return out


def sparse_all_reduce(tensor: Any, op: Any, group: Any, async_op: bool) -> Work | None:
    """Sum the sparse COO ``tensor`` across ``group`` in place (``async_op``: done on return).

    Raises:
        DistValueError: an op other than SUM (gloo's only one), too many dimensions, or members
            whose tensors have different shapes or dimension splits (named).
    """
    torch = sys.modules["torch"]
    if as_reduce_op(op) is not ReduceOp.SUM:
        raise DistValueError(f"all_reduce of a sparse tensor supports only ReduceOp.SUM, got {op}")
    g = _world.resolve_group(group)
    local = tensor.detach().coalesce()
    indices = local.indices().numpy()  # (sparse_dim, nnz) int64
    values = local.values()
    shape = list(tensor.shape)
    if len(shape) > _MAX_DIMS:
        raise DistValueError(
            f"all_reduce of a sparse tensor: at most {_MAX_DIMS} dimensions, got {len(shape)}"
        )
    head = np.full(3 + _MAX_DIMS, -1, dtype=np.int64)
    head[:3] = (indices.shape[1], tensor.sparse_dim(), len(shape))
    head[3 : 3 + len(shape)] = shape
    heads = _gather(head, group, g.size)
    for r in range(g.size):
        if not np.array_equal(heads[r][1:], head[1:]):
            raise DistValueError(
                f"all_reduce of a sparse tensor: rank {g.ranks[r]} has shape "
                f"{heads[r][3 : 3 + int(heads[r][2])].tolist()} with {heads[r][1]} sparse dimensions, "
                f"this rank {shape} with {tensor.sparse_dim()}"
            )
    counts = heads[:, 0].tolist()
    most = max(counts)
    padded_idx = np.zeros((indices.shape[0], most), dtype=np.int64)
    padded_idx[:, : indices.shape[1]] = indices
    dense_shape = tuple(values.shape[1:])
    padded_val = torch.zeros((most, *dense_shape), dtype=values.dtype)
    padded_val[: values.shape[0]] = values
    all_idx = _gather(padded_idx, group, g.size)
    all_val = torch.empty((g.size, most, *dense_shape), dtype=values.dtype)
    _blocking(lambda: _c.all_gather_into_tensor(all_val, padded_val, group))
    idx = np.concatenate([all_idx[r][:, : counts[r]] for r in range(g.size)], axis=1)
    val = torch.cat([all_val[r][: counts[r]] for r in range(g.size)])
    total = torch.sparse_coo_tensor(torch.from_numpy(idx), val, shape).coalesce()
    tensor.copy_(total)
    if async_op:
        return get_loop_thread().call(lambda: Work.completed(g.loop, "all_reduce (sparse)"))
    return None
