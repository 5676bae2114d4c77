"""torch.distributed-compatible collectives, blocking unless ``async_op=True``.

Signatures are torch's: ``src``/``dst`` are global ranks, ``group_src``/``group_dst`` the
same root given as a rank within ``group``. Object collectives always block, as in torch.
"""

from __future__ import annotations

import datetime
from typing import Any

import aiodist.face.object_collectives as _o
from aiodist._docs import SYNC_COLLECTIVE, SYNC_OBJECTS, contract, sync_collective
from aiodist.errors import DistTypeError
from aiodist.face.sparse import is_sparse, sparse_all_reduce
from aiodist.ops import ReduceOp
from aiodist.sync._bridge import call
from aiodist.sync._core import check_complex_op, seconds_of
from aiodist.sync._launch import run_entry
from aiodist.sync._preamble import ANY, resolved, torch_op
from aiodist.work import Work

__all__ = [
    "barrier",
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


@torch_op()
@contract(SYNC_COLLECTIVE)
def barrier(
    group: Any = None,
    async_op: bool = False,
    device_ids: Any = None,
    timeout: datetime.timedelta | None = None,
) -> Work | None:
    """Block until every member of ``group`` has entered the barrier (``async_op``: the Work).

    Args:
        group: the group (default: the world).
        async_op: return a Work at once instead of blocking.
        device_ids: accepted for torch's signature.
        timeout: this barrier's own timeout (``timedelta`` or seconds) instead of the group's.
    Returns:
        None once every member entered; with ``async_op=True`` at once, the ``Work``.
    """
    seconds = seconds_of(timeout)
    return run_entry("barrier", group, async_op, timeout=seconds)


@torch_op(root="src")
@contract(SYNC_COLLECTIVE)
def broadcast(
    tensor: Any,
    src: int | None = None,
    group: Any = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    """Copy the ``tensor`` of global rank ``src`` into ``tensor`` on every member of ``group``, in place.

    Args:
        tensor: the data on ``src``; where it is written on the others (same size and dtype).
        src: the source's global rank; or ``group_src``, its rank within ``group`` (one of them).
        group: the group (default: the world).
        async_op: return a Work at once instead of blocking.
    Returns:
        None once done; with ``async_op=True`` at once, the ``Work`` (``wait()`` blocks until done).
    """
    return run_entry("broadcast", group, async_op, tensor, resolved(src))


@torch_op()
@contract(SYNC_COLLECTIVE)
def all_reduce(tensor: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Work | None:
    """Reduce ``tensor`` element-wise across ``group``, in place; every member gets identical bytes.

    Args:
        tensor: a tensor or array (a sparse COO tensor is summed as gloo does).
        op: a ``ReduceOp`` (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR).
        group: the group (default: the world).
        async_op: return a Work at once instead of blocking.
    Returns:
        None once done; with ``async_op=True`` at once, the ``Work`` (``wait()`` blocks until done).
    """
    if op is not ReduceOp.SUM:
        check_complex_op("all_reduce", op, [tensor])
    try:
        return run_entry("all_reduce", group, async_op, tensor, op)
    except DistTypeError:
        if not is_sparse(tensor):
            raise
    return sparse_all_reduce(tensor, op, group, async_op)


@torch_op(root="dst")
@contract(SYNC_COLLECTIVE)
def reduce(
    tensor: Any,
    dst: int | None = None,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    """Reduce every member's ``tensor`` into the ``tensor`` of global rank ``dst`` (others' are not written).

    Args:
        tensor: the input; on ``dst`` also the output.
        dst: the destination's global rank; or ``group_dst``, its rank within ``group``.
        op: a ``ReduceOp``.
        group: the group (default: the world).
        async_op: return a Work at once instead of blocking.
    Returns:
        None once done; with ``async_op=True`` at once, the ``Work`` (``wait()`` blocks until done).
    """
    return run_entry("reduce", group, async_op, tensor, resolved(dst), op)


@torch_op()
@contract(SYNC_COLLECTIVE)
def all_gather(tensor_list: Any, tensor: Any, group: Any = None, async_op: bool = False) -> Work | None:
    """``tensor_list[i]`` = the ``tensor`` of group rank ``i``, on every member.

    Args:
        tensor_list: one output tensor per member, each the size and dtype of ``tensor``.
        tensor: this rank's input.
        group: the group (default: the world).
        async_op: return a Work at once instead of blocking.
    Returns:
        None once done; with ``async_op=True`` at once, the ``Work`` (``wait()`` blocks until done).
    """
    return run_entry("all_gather", group, async_op, tensor_list, tensor)


@torch_op()
@contract(SYNC_COLLECTIVE)
def all_gather_into_tensor(
    output_tensor: Any, input_tensor: Any, group: Any = None, async_op: bool = False
) -> Work | None:
    """``output_tensor`` = every member's ``input_tensor`` end to end, in group-rank order.

    Args:
        output_tensor: group size times the size of ``input_tensor`` (flat or stacked along dim 0).
        input_tensor: this rank's input.
        group: the group (default: the world).
        async_op: return a Work at once instead of blocking.
    Returns:
        None once done; with ``async_op=True`` at once, the ``Work`` (``wait()`` blocks until done).
    """
    return run_entry("all_gather_into_tensor", group, async_op, output_tensor, input_tensor)


all_gather_single = all_gather_into_tensor
_all_gather_base = all_gather_into_tensor


@torch_op(root="dst", root_default=0)
@contract(SYNC_COLLECTIVE)
def gather(
    tensor: Any,
    gather_list: Any = None,
    dst: int | None = None,
    group: Any = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    """Collect every member's ``tensor`` into ``gather_list`` on global rank ``dst``.

    Args:
        tensor: this rank's input.
        gather_list: on ``dst``, one output tensor per member; elsewhere None.
        dst: the destination's global rank (default 0); or ``group_dst``, its rank within ``group``.
        group: the group (default: the world).
        async_op: return a Work at once instead of blocking.
    Returns:
        None once done; with ``async_op=True`` at once, the ``Work`` (``wait()`` blocks until done).
    """
    return run_entry("gather", group, async_op, tensor, gather_list, resolved(dst))


@torch_op(root="src", root_default=0)
@contract(SYNC_COLLECTIVE)
def scatter(
    tensor: Any,
    scatter_list: Any = None,
    src: int | None = None,
    group: Any = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    """Member ``i``'s ``tensor`` = ``scatter_list[i]`` of global rank ``src``.

    Args:
        tensor: the output.
        scatter_list: on ``src``, one input tensor per member; elsewhere None.
        src: the source's global rank (default 0); or ``group_src``, its rank within ``group``.
        group: the group (default: the world).
        async_op: return a Work at once instead of blocking.
    Returns:
        None once done; with ``async_op=True`` at once, the ``Work`` (``wait()`` blocks until done).
    """
    return run_entry("scatter", group, async_op, tensor, scatter_list, resolved(src))


@torch_op()
@contract(SYNC_COLLECTIVE)
def reduce_scatter(
    output: Any, input_list: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Work | None:
    """``output`` on group rank ``r`` = the reduction over members of their ``input_list[r]``.

    Args:
        output: this rank's block of the result.
        input_list: one tensor per member, each the size and dtype of ``output``.
        op: a ``ReduceOp``.
        group: the group (default: the world).
        async_op: return a Work at once instead of blocking.
    Returns:
        None once done; with ``async_op=True`` at once, the ``Work`` (``wait()`` blocks until done).
    """
    return run_entry("reduce_scatter", group, async_op, output, input_list, op)


@torch_op()
@contract(SYNC_COLLECTIVE)
def reduce_scatter_tensor(
    output: Any, input: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Work | None:
    """As ``reduce_scatter`` with ``input`` cut into group-size equal blocks.

    Args:
        output: this rank's block of the result.
        input: group size times the size of ``output``.
        op: a ``ReduceOp``.
        group: the group (default: the world).
        async_op: return a Work at once instead of blocking.
    Returns:
        None once done; with ``async_op=True`` at once, the ``Work`` (``wait()`` blocks until done).
    """
    return run_entry("reduce_scatter_tensor", group, async_op, output, input, op)


reduce_scatter_single = reduce_scatter_tensor
_reduce_scatter_base = reduce_scatter_tensor


@torch_op()
@contract(SYNC_COLLECTIVE)
def all_to_all(
    output_tensor_list: Any, input_tensor_list: Any, group: Any = None, async_op: bool = False
) -> Work | None:
    """``output_tensor_list[i]`` = member ``i``'s ``input_tensor_list[this rank]``.

    Args:
        output_tensor_list: one output per member; sizes may differ per pair.
        input_tensor_list: one input per member.
        group: the group (default: the world).
        async_op: return a Work at once instead of blocking.
    Returns:
        None once done; with ``async_op=True`` at once, the ``Work`` (``wait()`` blocks until done).
    """
    return run_entry("all_to_all", group, async_op, output_tensor_list, input_tensor_list)


@torch_op()
@contract(SYNC_COLLECTIVE)
def all_to_all_single(
    output: Any,
    input: Any,
    output_split_sizes: Any = None,
    input_split_sizes: Any = None,
    group: Any = None,
    async_op: bool = False,
) -> Work | None:
    """Split ``input`` along dim 0, send block ``i`` to member ``i``; ``output`` = the blocks
    received, in member order.

    Args:
        output: the received blocks end to end.
        input: the blocks to send end to end.
        output_split_sizes: rows received from each member (None: equal blocks).
        input_split_sizes: rows sent to each member (None: equal blocks); ranks agree pairwise.
        group: the group (default: the world).
        async_op: return a Work at once instead of blocking.
    Returns:
        None once done; with ``async_op=True`` at once, the ``Work`` (``wait()`` blocks until done).
    """
    return run_entry(
        "all_to_all_single", group, async_op, output, input, output_split_sizes, input_split_sizes
    )


# -- objects (always blocking) -------------------------------------------------------------------


@torch_op(root="src", root_default=0)
@contract(SYNC_OBJECTS)
def broadcast_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: Any = None,
    device: Any = None,
    group_src: int | None = None,
) -> None:
    """Replace ``object_list`` on every member with global rank ``src``'s (picklable objects).

    Args:
        object_list: on ``src`` the objects; elsewhere a list of the same length, filled in place.
        src: the source's global rank (default 0); or ``group_src``, its rank within ``group``.
        group: the group (default: the world).
        device: accepted for torch's signature; objects travel on aiodist's own transport.
    Returns:
        None once done (object collectives always block, as in torch).
    """
    call(lambda: _o.broadcast_object_list(object_list, resolved(src), group), False)


@torch_op()
@contract(SYNC_OBJECTS)
def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    """``object_list[i]`` = the ``obj`` of group rank ``i`` (picklable), on every member.

    Args:
        object_list: one slot per member, filled in place.
        obj: this rank's object.
        group: the group (default: the world).
    Returns:
        None once done (object collectives always block, as in torch).
    """
    call(lambda: _o.all_gather_object(object_list, obj, group), False)


@torch_op(root="dst", root_default=0)
@contract(SYNC_OBJECTS)
def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: Any = None,
    group_dst: int | None = None,
) -> None:
    """Collect every member's ``obj`` into ``object_gather_list`` on global rank ``dst``.

    Args:
        obj: this rank's object (picklable).
        object_gather_list: on ``dst``, one slot per member, filled in place; elsewhere None.
        dst: the destination's global rank (default 0); or ``group_dst``, its rank within ``group``.
        group: the group (default: the world).
    Returns:
        None once done (object collectives always block, as in torch).
    """
    call(lambda: _o.gather_object(obj, object_gather_list, resolved(dst), group), False)


@torch_op(root="src", root_default=0)
@contract(SYNC_OBJECTS)
def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int | None = None,
    group: Any = None,
    group_src: int | None = None,
) -> None:
    """On member ``i``, ``scatter_object_output_list[0]`` = ``scatter_object_input_list[i]`` of
    global rank ``src``.

    Args:
        scatter_object_output_list: a list of at least one slot; its first is written.
        scatter_object_input_list: on ``src``, one object per member; elsewhere None.
        src: the source's global rank (default 0); or ``group_src``, its rank within ``group``.
        group: the group (default: the world).
    Returns:
        None once done (object collectives always block, as in torch).
    """
    call(
        lambda: _o.scatter_object_list(
            scatter_object_output_list, scatter_object_input_list, resolved(src), group
        ),
        False,
    )


@torch_op(root="dst")
@contract(SYNC_OBJECTS)
def send_object_list(
    object_list: list[Any],
    dst: int | None = None,
    group: Any = None,
    device: Any = None,
    group_dst: int | None = None,
    use_batch: bool = False,
) -> None:
    """Send the objects of ``object_list`` to global rank ``dst`` (which calls ``recv_object_list``).

    Args:
        object_list: the objects (picklable).
        dst: the receiver's global rank; or ``group_dst``, its rank within ``group``.
        group: the group (default: the world).
        device: accepted for torch's signature; objects travel on aiodist's own transport.
        use_batch: accepted for torch's signature.
    Returns:
        None once done (object collectives always block, as in torch).
    """
    call(lambda: _o.send_object_list(object_list, resolved(dst), group), False)


@torch_op(root="src", root_default=ANY, skipped=-1)
@contract(sync_collective(objects=True, returned="-1"))
def recv_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: Any = None,
    device: Any = None,
    group_src: int | None = None,
    use_batch: bool = False,
) -> int:
    """Receive into ``object_list`` the objects a ``send_object_list`` sent here.

    Args:
        object_list: a list as long as the sender's, filled in place.
        src: the sender's global rank (None: any member); or ``group_src``, its rank within ``group``.
        group: the group (default: the world).
        device: accepted for torch's signature; objects travel on aiodist's own transport.
        use_batch: accepted for torch's signature.
    Returns:
        The sender's global rank (blocking, as in torch).
    """
    return int(call(lambda: _o.recv_object_list(object_list, src, group), False))
