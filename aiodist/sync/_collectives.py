"""torch.distributed-compatible collectives, blocking unless ``async_op=True``.

Signatures are torch's: ``src``/``dst`` are global ranks, ``group_src``/``group_dst`` the
same root given as a rank within ``group``. Object collectives always block, as in torch.
"""

from __future__ import annotations

from typing import Any

import aiodist.face.object_collectives as _o
import aiodist.face.tensor_collectives as _c
import aiodist.face.world as _world
from aiodist.errors import DistTypeError, DistValueError
from aiodist.ops import ReduceOp
from aiodist.sync._bridge import call
from aiodist.sync._core import check_complex_op, not_in_group
from aiodist.sync._launch import run_op, run_out_in
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


def _root(rank: int | None, group_rank: int | None, group: Any, arg: str, default: int | None = None) -> int:
    """The global root from torch's ``src``/``dst`` or ``group_src``/``group_dst``."""
    if group_rank is not None:
        if rank is not None:
            raise DistValueError(f"pass either {arg} or group_{arg}, not both")
        g = _world.resolve_group(group)
        if not isinstance(group_rank, int) or not 0 <= group_rank < g.size:
            raise DistValueError(f"group_{arg}={group_rank!r} is not a rank of a group of size {g.size}")
        return g.ranks[group_rank]
    if rank is None:
        if default is None:
            raise DistValueError(f"{arg} (a global rank) or group_{arg} (a rank in group) is required")
        return default  # torch's default root is global rank 0
    return rank


def broadcast(
    tensor: Any,
    src: int | None = None,
    group: Any = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    if not_in_group(group, "broadcast"):
        return None
    root = _root(src, group_src, group, "src")
    return run_op("broadcast", lambda t: _c.broadcast(t, root, group), async_op, tensor)  # type: ignore[no-any-return]


def all_reduce(tensor: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Work | None:
    """torch's ``all_reduce``; a sparse COO tensor is summed as gloo does (see ``_sparse``)."""
    if not_in_group(group, "all_reduce"):
        return None
    if op is not ReduceOp.SUM:
        check_complex_op("all_reduce", op, [tensor])
    try:
        return run_op("all_reduce", lambda t: _c.all_reduce(t, op, group), async_op, tensor)  # type: ignore[no-any-return]
    except DistTypeError:
        if not is_sparse(tensor):
            raise
    return sparse_all_reduce(tensor, op, group, async_op)


def reduce(
    tensor: Any,
    dst: int | None = None,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    if not_in_group(group, "reduce"):
        return None
    root = _root(dst, group_dst, group, "dst")
    return run_op("reduce", lambda t: _c.reduce(t, root, op, group), async_op, tensor)  # type: ignore[no-any-return]


def all_gather(tensor_list: Any, tensor: Any, group: Any = None, async_op: bool = False) -> Work | None:
    if not_in_group(group, "all_gather"):
        return None
    return run_out_in("all_gather", lambda o, i: _c.all_gather(o, i, group), async_op, tensor_list, tensor)


def all_gather_into_tensor(
    output_tensor: Any, input_tensor: Any, group: Any = None, async_op: bool = False
) -> Work | None:
    if not_in_group(group, "all_gather_into_tensor"):
        return None
    return run_out_in(
        "_allgather_base",
        lambda o, i: _c.all_gather_into_tensor(o, i, group),
        async_op,
        output_tensor,
        input_tensor,
    )


all_gather_single = all_gather_into_tensor
_all_gather_base = all_gather_into_tensor


def gather(
    tensor: Any,
    gather_list: Any = None,
    dst: int | None = None,
    group: Any = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    if not_in_group(group, "gather"):
        return None
    root = _root(dst, group_dst, group, "dst", default=0)
    return run_op(  # type: ignore[no-any-return]
        "gather", lambda t, o: _c.gather(t, o, root, group), async_op, tensor, gather_list, inputs=0
    )


def scatter(
    tensor: Any,
    scatter_list: Any = None,
    src: int | None = None,
    group: Any = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    if not_in_group(group, "scatter"):
        return None
    root = _root(src, group_src, group, "src", default=0)
    return run_out_in("scatter", lambda t, i: _c.scatter(t, i, root, group), async_op, tensor, scatter_list)


def reduce_scatter(
    output: Any, input_list: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Work | None:
    if not_in_group(group, "reduce_scatter"):
        return None
    return run_out_in(
        "reduce_scatter", lambda o, i: _c.reduce_scatter(o, i, op, group), async_op, output, input_list
    )


def reduce_scatter_tensor(
    output: Any, input: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Work | None:
    if not_in_group(group, "reduce_scatter_tensor"):
        return None
    return run_out_in(
        "_reduce_scatter_base",
        lambda o, i: _c.reduce_scatter_tensor(o, i, op, group),
        async_op,
        output,
        input,
    )


reduce_scatter_single = reduce_scatter_tensor
_reduce_scatter_base = reduce_scatter_tensor


def all_to_all(
    output_tensor_list: Any, input_tensor_list: Any, group: Any = None, async_op: bool = False
) -> Work | None:
    if not_in_group(group, "all_to_all"):
        return None
    return run_out_in(
        "all_to_all", lambda o, i: _c.all_to_all(o, i, group), async_op, output_tensor_list, input_tensor_list
    )


def all_to_all_single(
    output: Any,
    input: Any,
    output_split_sizes: Any = None,
    input_split_sizes: Any = None,
    group: Any = None,
    async_op: bool = False,
) -> Work | None:
    if not_in_group(group, "all_to_all_single"):
        return None
    return run_out_in(
        "alltoall_base",
        lambda o, i: _c.all_to_all_single(o, i, output_split_sizes, input_split_sizes, group),
        async_op,
        output,
        input,
    )


# -- objects (always blocking) -------------------------------------------------------------------


def broadcast_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: Any = None,
    device: Any = None,
    group_src: int | None = None,
) -> None:
    if not_in_group(group, "broadcast_object_list"):
        return None
    root = _root(src, group_src, group, "src", default=0)
    call(lambda: _o.broadcast_object_list(object_list, root, group), False)


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    if not_in_group(group, "all_gather_object"):
        return None
    call(lambda: _o.all_gather_object(object_list, obj, group), False)


def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: Any = None,
    group_dst: int | None = None,
) -> None:
    if not_in_group(group, "gather_object"):
        return None
    root = _root(dst, group_dst, group, "dst", default=0)
    call(lambda: _o.gather_object(obj, object_gather_list, root, group), False)


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int | None = None,
    group: Any = None,
    group_src: int | None = None,
) -> None:
    if not_in_group(group, "scatter_object_list"):
        return None
    root = _root(src, group_src, group, "src", default=0)
    call(
        lambda: _o.scatter_object_list(scatter_object_output_list, scatter_object_input_list, root, group),
        False,
    )


def send_object_list(
    object_list: list[Any],
    dst: int | None = None,
    group: Any = None,
    device: Any = None,
    group_dst: int | None = None,
    use_batch: bool = False,
) -> None:
    if not_in_group(group, "send_object_list"):
        return None
    peer = _root(dst, group_dst, group, "dst")
    call(lambda: _o.send_object_list(object_list, peer, group), False)


def recv_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: Any = None,
    device: Any = None,
    group_src: int | None = None,
    use_batch: bool = False,
) -> int:
    if not_in_group(group, "recv_object_list"):
        return -1
    peer = None if src is None and group_src is None else _root(src, group_src, group, "src")
    return int(call(lambda: _o.recv_object_list(object_list, peer, group), False))
