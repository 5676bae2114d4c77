"""The tensor collectives of the async face: one declaration per entry of the operation table
(``aiodist.operations``), whose body runs the entry by name on the resolved group.

The group checks the arguments (before taking a sequence number, so a refused call leaves the
group's numbering untouched on this rank), numbers the operation, whose fingerprint (op,
sequence number, dtype, element count, root, reduce op, and the task that started it) travels
with every message so that ranks disagreeing on any of them get a ``CollectiveMismatchError``, and starts it on its
backend; it returns a ``Work`` at once. Ranks (``src``, ``dst``) are global ranks, as in torch.
Output buffers are written in place; on failure or timeout they may hold partial data.
"""

from __future__ import annotations

from typing import Any

from aiodist._docs import ASYNC_COLLECTIVE, async_collective, contract
from aiodist.face.world import resolve_group
from aiodist.ops import ReduceOp
from aiodist.work import Work

__all__ = [
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
]


@contract(ASYNC_COLLECTIVE)
def barrier(group: Any = None, *, timeout: float | None = None) -> Work:
    """Complete once every member of ``group`` has entered the barrier.

    Args:
        group: the group (default: the world).
        timeout: seconds for this operation instead of the group's timeout.
    Returns:
        A ``Work``, at once: await it (or ``wait()`` from another thread); its result is None.
    """
    return resolve_group(group).collective("barrier", timeout=timeout)


@contract(
    async_collective("On a receiving rank a read-only tensor, or ``src`` not a member, is refused here.")
)
def broadcast(tensor: Any, src: int, group: Any = None, *, timeout: float | None = None) -> Work:
    """Copy global rank ``src``'s ``tensor`` into ``tensor`` on every member of ``group``.

    Args:
        tensor: the data on ``src``; where it is written on the others (same size and dtype).
        src: the source's global rank.
        group: the group (default: the world).
        timeout: seconds for this operation instead of the group's timeout.
    Returns:
        A ``Work``, at once: await it (or ``wait()`` from another thread); its result is None.
    """
    return resolve_group(group).collective("broadcast", tensor, src, timeout=timeout)


@contract(
    async_collective(
        "An op that makes no sense for the dtype (BXOR on floats, MIN on complex) is a DistTypeError."
    )
)
def all_reduce(
    tensor: Any, op: Any = ReduceOp.SUM, group: Any = None, *, timeout: float | None = None
) -> Work:
    """Reduce ``tensor`` element-wise across ``group``, in place; every rank gets identical bytes.

    Args:
        tensor: a numpy array or CPU torch tensor, written in place.
        op: a ``ReduceOp`` (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR).
        group: the group (default: the world).
        timeout: seconds for this operation instead of the group's timeout.
    Returns:
        A ``Work``, at once: await it (or ``wait()`` from another thread); its result is None.
    """
    return resolve_group(group).collective("all_reduce", tensor, op, timeout=timeout)


@contract(ASYNC_COLLECTIVE)
def reduce(
    tensor: Any, dst: int, op: Any = ReduceOp.SUM, group: Any = None, *, timeout: float | None = None
) -> Work:
    """Reduce every member's ``tensor`` into global rank ``dst``'s ``tensor`` (others are not written).

    Args:
        tensor: the input; on ``dst`` also the output.
        dst: the destination's global rank.
        op: a ``ReduceOp``.
        group: the group (default: the world).
        timeout: seconds for this operation instead of the group's timeout.
    Returns:
        A ``Work``, at once: await it (or ``wait()`` from another thread); its result is None.
    """
    return resolve_group(group).collective("reduce", tensor, dst, op, timeout=timeout)


@contract(ASYNC_COLLECTIVE)
def all_gather(tensor_list: Any, tensor: Any, group: Any = None, *, timeout: float | None = None) -> Work:
    """``tensor_list[i]`` = group rank i's ``tensor``, on every member.

    Args:
        tensor_list: one output per member, each the size and dtype of ``tensor``.
        tensor: this rank's input.
        group: the group (default: the world).
        timeout: seconds for this operation instead of the group's timeout.
    Returns:
        A ``Work``, at once: await it (or ``wait()`` from another thread); its result is None.
    """
    return resolve_group(group).collective("all_gather", tensor_list, tensor, timeout=timeout)


@contract(ASYNC_COLLECTIVE)
def all_gather_into_tensor(
    output_tensor: Any, input_tensor: Any, group: Any = None, *, timeout: float | None = None
) -> Work:
    """``output_tensor`` = the concatenation of every member's ``input_tensor``, in group-rank order.

    Args:
        output_tensor: group size times the size of ``input_tensor``.
        input_tensor: this rank's input.
        group: the group (default: the world).
        timeout: seconds for this operation instead of the group's timeout.
    Returns:
        A ``Work``, at once: await it (or ``wait()`` from another thread); its result is None.
    """
    return resolve_group(group).collective(
        "all_gather_into_tensor", output_tensor, input_tensor, timeout=timeout
    )


all_gather_single = all_gather_into_tensor


@contract(ASYNC_COLLECTIVE)
def gather(
    tensor: Any, gather_list: Any = None, dst: int = 0, group: Any = None, *, timeout: float | None = None
) -> Work:
    """Collect every member's ``tensor`` into ``gather_list`` on global rank ``dst``.

    ``gather_list`` must be given on ``dst`` only (one tensor per member).

    Args:
        tensor: this rank's input.
        gather_list: on ``dst``, one output per member; elsewhere None.
        dst: the destination's global rank (default 0).
        group: the group (default: the world).
        timeout: seconds for this operation instead of the group's timeout.
    Returns:
        A ``Work``, at once: await it (or ``wait()`` from another thread); its result is None.
    """
    return resolve_group(group).collective("gather", tensor, gather_list, dst, timeout=timeout)


@contract(ASYNC_COLLECTIVE)
def scatter(
    tensor: Any, scatter_list: Any = None, src: int = 0, group: Any = None, *, timeout: float | None = None
) -> Work:
    """Member i's ``tensor`` = ``scatter_list[i]`` of global rank ``src``.

    ``scatter_list`` must be given on ``src`` only (one tensor per member).

    Args:
        tensor: the output.
        scatter_list: on ``src``, one input per member; elsewhere None.
        src: the source's global rank (default 0).
        group: the group (default: the world).
        timeout: seconds for this operation instead of the group's timeout.
    Returns:
        A ``Work``, at once: await it (or ``wait()`` from another thread); its result is None.
    """
    return resolve_group(group).collective("scatter", tensor, scatter_list, src, timeout=timeout)


@contract(ASYNC_COLLECTIVE)
def reduce_scatter(
    output: Any, input_list: Any, op: Any = ReduceOp.SUM, group: Any = None, *, timeout: float | None = None
) -> Work:
    """``output`` on group rank r = the reduction over members of their ``input_list[r]``.

    Args:
        output: this rank's block of the result.
        input_list: one tensor per member, each the size and dtype of ``output``.
        op: a ``ReduceOp``.
        group: the group (default: the world).
        timeout: seconds for this operation instead of the group's timeout.
    Returns:
        A ``Work``, at once: await it (or ``wait()`` from another thread); its result is None.
    """
    return resolve_group(group).collective("reduce_scatter", output, input_list, op, timeout=timeout)


@contract(ASYNC_COLLECTIVE)
def reduce_scatter_tensor(
    output: Any, input: Any, op: Any = ReduceOp.SUM, group: Any = None, *, timeout: float | None = None
) -> Work:
    """As ``reduce_scatter`` with ``input`` cut into group-size equal blocks.

    Args:
        output: this rank's block of the result.
        input: group size times the size of ``output``.
        op: a ``ReduceOp``.
        group: the group (default: the world).
        timeout: seconds for this operation instead of the group's timeout.
    Returns:
        A ``Work``, at once: await it (or ``wait()`` from another thread); its result is None.
    """
    return resolve_group(group).collective("reduce_scatter_tensor", output, input, op, timeout=timeout)


reduce_scatter_single = reduce_scatter_tensor


@contract(ASYNC_COLLECTIVE)
def all_to_all(
    output_tensor_list: Any, input_tensor_list: Any, group: Any = None, *, timeout: float | None = None
) -> Work:
    """``output_tensor_list[i]`` = member i's ``input_tensor_list[this rank]``; sizes may differ per pair.

    Args:
        output_tensor_list: one output per member.
        input_tensor_list: one input per member.
        group: the group (default: the world).
        timeout: seconds for this operation instead of the group's timeout.
    Returns:
        A ``Work``, at once: await it (or ``wait()`` from another thread); its result is None.
    """
    return resolve_group(group).collective(
        "all_to_all", output_tensor_list, input_tensor_list, timeout=timeout
    )


@contract(ASYNC_COLLECTIVE)
def all_to_all_single(
    output: Any,
    input: Any,
    output_split_sizes: Any = None,
    input_split_sizes: Any = None,
    group: Any = None,
    *,
    timeout: float | None = None,
) -> Work:
    """Split ``input`` along dim 0 by ``input_split_sizes`` (default: evenly), send block i to
    member i, and fill ``output`` with the blocks received, in member order, split by
    ``output_split_sizes``. Ranks must agree pairwise on block sizes.

    Args:
        output: the received blocks end to end.
        input: the blocks to send end to end.
        output_split_sizes: rows received from each member (None: equal blocks).
        input_split_sizes: rows sent to each member (None: equal blocks).
        group: the group (default: the world).
        timeout: seconds for this operation instead of the group's timeout.
    Returns:
        A ``Work``, at once: await it (or ``wait()`` from another thread); its result is None.
    """
    return resolve_group(group).collective(
        "all_to_all_single", output, input, output_split_sizes, input_split_sizes, timeout=timeout
    )
