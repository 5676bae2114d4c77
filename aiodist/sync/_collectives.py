"""torch.distributed-compatible collectives, blocking unless ``async_op=True``.

Signatures are torch's: ``src``/``dst`` are global ranks, ``group_src``/``group_dst`` the
same root given as a rank within ``group``. Object collectives always block, as in torch.
"""

from __future__ import annotations

from typing import Any

import aiodist._collectives as _c
import aiodist._objects as _o
from aiodist.errors import DistTypeError
from aiodist.ops import ReduceOp
from aiodist.sync._bridge import call
from aiodist.sync._core import check_complex_op
from aiodist.sync._launch import run_op, run_out_in
from aiodist.sync._preamble import ANY, resolved, torch_op
from aiodist.sync._sparse import is_sparse, sparse_all_reduce
from aiodist.work import Work

__all__ = [
    "_all_gather_base",
    "_reduce_scatter_base",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "recv_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send_object_list",
]


@torch_op(root="src")
def broadcast(
    tensor: Any,
    src: int | None = None,
    group: Any = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    return run_op("broadcast", lambda t: _c.broadcast(t, resolved(src), group), async_op, tensor)  # type: ignore[no-any-return]


@torch_op()
def all_reduce(tensor: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Work | None:
    """torch's ``all_reduce``; a sparse COO tensor is summed as gloo does (see ``_sparse``)."""
    if op is not ReduceOp.SUM:
        check_complex_op("all_reduce", op, [tensor])
    try:
        return run_op("all_reduce", lambda t: _c.all_reduce(t, op, group), async_op, tensor)  # type: ignore[no-any-return]
    except DistTypeError:
        if not is_sparse(tensor):
            raise
    return sparse_all_reduce(tensor, op, group, async_op)


@torch_op(root="dst")
def reduce(
    tensor: Any,
    dst: int | None = None,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    return run_op("reduce", lambda t: _c.reduce(t, resolved(dst), op, group), async_op, tensor)  # type: ignore[no-any-return]


@torch_op()
def all_gather(tensor_list: Any, tensor: Any, group: Any = None, async_op: bool = False) -> Work | None:
    return run_out_in("all_gather", lambda o, i: _c.all_gather(o, i, group), async_op, tensor_list, tensor)


@torch_op()
def all_gather_into_tensor(
    output_tensor: Any, input_tensor: Any, group: Any = None, async_op: bool = False
) -> Work | None:
    return run_out_in(
        "_allgather_base",
        lambda o, i: _c.all_gather_into_tensor(o, i, group),
        async_op,
        output_tensor,
        input_tensor,
    )


all_gather_single = all_gather_into_tensor
_all_gather_base = all_gather_into_tensor


@torch_op(root="dst", root_default=0)
def gather(
    tensor: Any,
    gather_list: Any = None,
    dst: int | None = None,
    group: Any = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    return run_op(  # type: ignore[no-any-return]
        "gather", lambda t, o: _c.gather(t, o, resolved(dst), group), async_op, tensor, gather_list, inputs=0
    )


@torch_op(root="src", root_default=0)
def scatter(
    tensor: Any,
    scatter_list: Any = None,
    src: int | None = None,
    group: Any = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    return run_out_in(
        "scatter", lambda t, i: _c.scatter(t, i, resolved(src), group), async_op, tensor, scatter_list
    )


@torch_op()
def reduce_scatter(
    output: Any, input_list: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Work | None:
    return run_out_in(
        "reduce_scatter", lambda o, i: _c.reduce_scatter(o, i, op, group), async_op, output, input_list
    )


@torch_op()
def reduce_scatter_tensor(
    output: Any, input: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Work | None:
    return run_out_in(
        "_reduce_scatter_base",
        lambda o, i: _c.reduce_scatter_tensor(o, i, op, group),
        async_op,
        output,
        input,
    )


reduce_scatter_single = reduce_scatter_tensor
_reduce_scatter_base = reduce_scatter_tensor


@torch_op()
def all_to_all(
    output_tensor_list: Any, input_tensor_list: Any, group: Any = None, async_op: bool = False
) -> Work | None:
    return run_out_in(
        "all_to_all", lambda o, i: _c.all_to_all(o, i, group), async_op, output_tensor_list, input_tensor_list
    )


@torch_op()
def all_to_all_single(
    output: Any,
    input: Any,
    output_split_sizes: Any = None,
    input_split_sizes: Any = None,
    group: Any = None,
    async_op: bool = False,
) -> Work | None:
    return run_out_in(
        "alltoall_base",
        lambda o, i: _c.all_to_all_single(o, i, output_split_sizes, input_split_sizes, group),
        async_op,
        output,
        input,
    )


# -- objects (always blocking) -------------------------------------------------------------------


@torch_op(root="src", root_default=0)
def broadcast_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: Any = None,
    device: Any = None,
    group_src: int | None = None,
) -> None:
    call(lambda: _o.broadcast_object_list(object_list, resolved(src), group), False)


@torch_op()
def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    call(lambda: _o.all_gather_object(object_list, obj, group), False)


@torch_op(root="dst", root_default=0)
def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: Any = None,
    group_dst: int | None = None,
) -> None:
    call(lambda: _o.gather_object(obj, object_gather_list, resolved(dst), group), False)


@torch_op(root="src", root_default=0)
def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int | None = None,
    group: Any = None,
    group_src: int | None = None,
) -> None:
    call(
        lambda: _o.scatter_object_list(
            scatter_object_output_list, scatter_object_input_list, resolved(src), group
        ),
        False,
    )


@torch_op(root="dst")
def send_object_list(
    object_list: list[Any],
    dst: int | None = None,
    group: Any = None,
    device: Any = None,
    group_dst: int | None = None,
    use_batch: bool = False,
) -> None:
    call(lambda: _o.send_object_list(object_list, resolved(dst), group), False)


@torch_op(root="src", root_default=ANY, skipped=-1)
def recv_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: Any = None,
    device: Any = None,
    group_src: int | None = None,
    use_batch: bool = False,
) -> int:
    return int(call(lambda: _o.recv_object_list(object_list, src, group), False))
