"""Collective operations of the async face.

Each call validates its arguments once (before taking a sequence number, so a refused call
leaves the group's numbering untouched on this rank), takes the group's next operation,
whose fingerprint (op, sequence number, dtype, element count, root, reduce op) travels with
every message so that ranks disagreeing on any of them get a ``CollectiveMismatchError``,
and starts the algorithm; it returns a ``Work`` at once. Ranks (``src``, ``dst``) are global
ranks, as in torch. Output buffers are written in place; on failure or timeout they may hold
partial data.

Fingerprint counts: the element count of the tensor every rank passes with the same size
(``tensor``; ``all_gather``: the input; ``gather``: the input; ``scatter``/``reduce_scatter``:
the output). ``all_to_all`` blocks may legitimately differ per pair, so their count is -1 and
each receive's exact byte check catches sizes that disagree.
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import Any

from aiodist import _tensors
from aiodist.backends import staged as _staging
from aiodist.backends.staged import IN, INOUT, OUT
from aiodist.collectives.allgather import allgather as _allgather
from aiodist.collectives.allreduce import allreduce as _allreduce
from aiodist.collectives.alltoall import alltoall as _alltoall
from aiodist.collectives.broadcast import broadcast as _broadcast
from aiodist.collectives.context import OpContext
from aiodist.collectives.detail import check_fingerprints, detail_enabled
from aiodist.collectives.gather import gather as _gather
from aiodist.collectives.gather import scatter as _scatter
from aiodist.collectives.reduce import reduce as _reduce
from aiodist.collectives.reduce_scatter import reduce_scatter as _reduce_scatter
from aiodist.errors import DistTypeError, DistValueError
from aiodist.face.dispatch import routed
from aiodist.face.world import resolve_group
from aiodist.group import ProcessGroup
from aiodist.ops import ReduceOp, check_reduce, dtype_name
from aiodist.work import Work

__all__ = [
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "gather",
    "launch",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
]

Array = Any  # a flat numpy view (see _tensors.as_array)


# -- shared plumbing ---------------------------------------------------------------------------


def launch(
    group: ProcessGroup, ctx: OpContext, coro: Coroutine[Any, Any, Any], timeout: float | None
) -> Work:
    """Start ``coro`` as the collective ``ctx``; with ``AIODIST_DEBUG=DETAIL`` check agreement first.

    The DETAIL check runs before the operation is handed to the group, so a disagreement is
    raised by every rank from the same table of fingerprints (no rank's failure notice can
    overtake another rank's own verdict) and the algorithm never starts.
    """
    coro = _staging.gated(coro)  # a staged call's inputs reach host memory first
    if not detail_enabled():
        return group.collective(ctx, coro, timeout)
    t = group.timeout if timeout is None else timeout
    # Shortly before the operation's own deadline, so a rank that never arrives is named.
    check_timeout = t * 0.9 if t and 0 < t < float("inf") else None

    async def checked() -> Any:
        await check_fingerprints(ctx, check_timeout, coro)
        return await group.collective(ctx, coro, timeout)

    name = f"{ctx.fp[0]} #{ctx.fp[1]}" if ctx.fp else "collective"
    return Work(group.loop.create_task(checked()), name)


def _member(group: Any, what: str) -> ProcessGroup:
    g = resolve_group(group)
    g.check_usable(what)
    return g


def _root(g: ProcessGroup, rank: Any, arg: str) -> int:
    """Group rank of the global rank ``rank`` given as ``arg``."""
    return g.group_rank(rank, arg)


def _reduce_op(op: Any, arr: Array) -> ReduceOp:
    return check_reduce(op, arr.dtype)


def _tensor_list(
    objs: Any, arg: str, *, writable: bool, length: int, like: Array | None, same_size: bool = True
) -> list[Array]:
    """Views of a tensor list of ``length`` items sharing ``like``'s dtype (and size)."""
    if not isinstance(objs, list | tuple):
        raise DistTypeError(f"{arg} must be a list of tensors, got {type(objs).__qualname__}")
    if len(objs) != length:
        raise DistValueError(f"{arg} must have one tensor per group member ({length}), got {len(objs)}")
    arrs = _tensors.as_arrays(objs, arg=arg, writable=writable)
    ref = like if like is not None else (arrs[0] if arrs else None)
    for i, a in enumerate(arrs):
        if ref is None:
            break
        if a.dtype != ref.dtype:
            raise DistTypeError(
                f"{arg}[{i}] has dtype {dtype_name(a.dtype)} but {dtype_name(ref.dtype)} was expected"
            )
        if same_size and a.size != ref.size:
            raise DistValueError(f"{arg}[{i}] has {a.size} elements but {ref.size} were expected")
    return arrs


def _same_dtype(a: Array, b: Array, arg_a: str, arg_b: str) -> None:
    if a.dtype != b.dtype:
        raise DistTypeError(
            f"{arg_a} ({dtype_name(a.dtype)}) and {arg_b} ({dtype_name(b.dtype)}) must have the same dtype"
        )


def _split(arr: Array, n: int) -> list[Array]:
    b = arr.size // n
    return [arr[i * b : (i + 1) * b] for i in range(n)]


# -- tensor collectives ------------------------------------------------------------------------


@routed(tensor=INOUT)
def broadcast(tensor: Any, src: int, group: Any = None, *, timeout: float | None = None) -> Work:
    """Copy global rank ``src``'s ``tensor`` into ``tensor`` on every member of ``group``.

    Args:
        tensor: the data on ``src``; where it is written on the others (same size and dtype).
        src: the source's global rank.
        group: the group (default: the world).
        timeout: seconds for this operation instead of the group's timeout.
    Returns:
        A ``Work``, at once: await it (or ``wait()`` from another thread); its result is None.
    Raises:
        ValueError / TypeError (``DistValueError``, ``DistTypeError``): a bad argument (tensor,
            dtype, rank, list length), raised here at the call, before anything is sent.
            On a receiving rank a read-only tensor, or ``src`` not a member, is refused here.
        DistTimeoutError, DistNetworkError, CollectiveMismatchError: from awaiting the Work: the
            timeout ran out (naming the ranks that did not arrive), a member was lost, or members
            called different operations or with different sizes, dtypes or roots.

    A timeout abandons the operation on this rank only: its outputs may hold partial data, and
    the group goes on (stale messages of the operation are discarded), unless the ranks
    disagree about which operations ran: then it is out of step until ``resync``. A lost member
    breaks every group holding it: destroy_process_group, then init again.
    """
    g = _member(group, "broadcast")
    root = _root(g, src, "src")
    arr = _tensors.as_array(tensor, arg="tensor", writable=g.rank != root)
    ctx = g.next_op("broadcast", dtype=dtype_name(arr.dtype), count=arr.size, root=g.ranks[root])
    return launch(g, ctx, _broadcast(ctx, arr, root), timeout)


@routed(tensor=INOUT)
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
    Raises:
        ValueError / TypeError (``DistValueError``, ``DistTypeError``): a bad argument (tensor,
            dtype, rank, list length), raised here at the call, before anything is sent.
            An op that makes no sense for the dtype (BXOR on floats, MIN on complex) is a DistTypeError.
        DistTimeoutError, DistNetworkError, CollectiveMismatchError: from awaiting the Work: the
            timeout ran out (naming the ranks that did not arrive), a member was lost, or members
            called different operations or with different sizes, dtypes or roots.

    A timeout abandons the operation on this rank only: its outputs may hold partial data, and
    the group goes on (stale messages of the operation are discarded), unless the ranks
    disagree about which operations ran: then it is out of step until ``resync``. A lost member
    breaks every group holding it: destroy_process_group, then init again.
    """
    g = _member(group, "all_reduce")
    arr = _tensors.as_array(tensor, arg="tensor", writable=True)
    rop = _reduce_op(op, arr)
    ctx = g.next_op("all_reduce", dtype=dtype_name(arr.dtype), count=arr.size, redop=rop.name)
    return launch(g, ctx, _allreduce(ctx, arr, rop), timeout)


@routed(tensor=INOUT)
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
    Raises:
        ValueError / TypeError (``DistValueError``, ``DistTypeError``): a bad argument (tensor,
            dtype, rank, list length), raised here at the call, before anything is sent.
        DistTimeoutError, DistNetworkError, CollectiveMismatchError: from awaiting the Work: the
            timeout ran out (naming the ranks that did not arrive), a member was lost, or members
            called different operations or with different sizes, dtypes or roots.

    A timeout abandons the operation on this rank only: its outputs may hold partial data, and
    the group goes on (stale messages of the operation are discarded), unless the ranks
    disagree about which operations ran: then it is out of step until ``resync``. A lost member
    breaks every group holding it: destroy_process_group, then init again.
    """
    g = _member(group, "reduce")
    root = _root(g, dst, "dst")
    arr = _tensors.as_array(tensor, arg="tensor", writable=g.rank == root)
    rop = _reduce_op(op, arr)
    ctx = g.next_op("reduce", dtype=dtype_name(arr.dtype), count=arr.size, root=g.ranks[root], redop=rop.name)
    return launch(g, ctx, _reduce(ctx, arr, rop, root), timeout)


@routed(tensor_list=OUT, tensor=IN)
def all_gather(tensor_list: Any, tensor: Any, group: Any = None, *, timeout: float | None = None) -> Work:
    """``tensor_list[i]`` = group rank i's ``tensor``, on every member.

    Args:
        tensor_list: one output per member, each the size and dtype of ``tensor``.
        tensor: this rank's input.
        group: the group (default: the world).
        timeout: seconds for this operation instead of the group's timeout.
    Returns:
        A ``Work``, at once: await it (or ``wait()`` from another thread); its result is None.
    Raises:
        ValueError / TypeError (``DistValueError``, ``DistTypeError``): a bad argument (tensor,
            dtype, rank, list length), raised here at the call, before anything is sent.
        DistTimeoutError, DistNetworkError, CollectiveMismatchError: from awaiting the Work: the
            timeout ran out (naming the ranks that did not arrive), a member was lost, or members
            called different operations or with different sizes, dtypes or roots.

    A timeout abandons the operation on this rank only: its outputs may hold partial data, and
    the group goes on (stale messages of the operation are discarded), unless the ranks
    disagree about which operations ran: then it is out of step until ``resync``. A lost member
    breaks every group holding it: destroy_process_group, then init again.
    """
    g = _member(group, "all_gather")
    inp = _tensors.as_array(tensor, arg="tensor", writable=False)
    outs = _tensor_list(tensor_list, "tensor_list", writable=True, length=g.size, like=inp)
    ctx = g.next_op("all_gather", dtype=dtype_name(inp.dtype), count=inp.size)
    return launch(g, ctx, _allgather(ctx, outs, inp), timeout)


@routed(output_tensor=OUT, input_tensor=IN)
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
    Raises:
        ValueError / TypeError (``DistValueError``, ``DistTypeError``): a bad argument (tensor,
            dtype, rank, list length), raised here at the call, before anything is sent.
        DistTimeoutError, DistNetworkError, CollectiveMismatchError: from awaiting the Work: the
            timeout ran out (naming the ranks that did not arrive), a member was lost, or members
            called different operations or with different sizes, dtypes or roots.

    A timeout abandons the operation on this rank only: its outputs may hold partial data, and
    the group goes on (stale messages of the operation are discarded), unless the ranks
    disagree about which operations ran: then it is out of step until ``resync``. A lost member
    breaks every group holding it: destroy_process_group, then init again.
    """
    g = _member(group, "all_gather_into_tensor")
    inp = _tensors.as_array(input_tensor, arg="input_tensor", writable=False)
    out = _tensors.as_array(output_tensor, arg="output_tensor", writable=True)
    _same_dtype(out, inp, "output_tensor", "input_tensor")
    if out.size != inp.size * g.size:
        raise DistValueError(
            f"output_tensor has {out.size} elements but must have group size x input_tensor's = "
            f"{g.size} x {inp.size}"
        )
    ctx = g.next_op("all_gather_into_tensor", dtype=dtype_name(inp.dtype), count=inp.size)
    return launch(g, ctx, _allgather(ctx, _split(out, g.size), inp), timeout)


all_gather_single = all_gather_into_tensor


@routed(tensor=IN, gather_list=OUT)
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
    Raises:
        ValueError / TypeError (``DistValueError``, ``DistTypeError``): a bad argument (tensor,
            dtype, rank, list length), raised here at the call, before anything is sent.
        DistTimeoutError, DistNetworkError, CollectiveMismatchError: from awaiting the Work: the
            timeout ran out (naming the ranks that did not arrive), a member was lost, or members
            called different operations or with different sizes, dtypes or roots.

    A timeout abandons the operation on this rank only: its outputs may hold partial data, and
    the group goes on (stale messages of the operation are discarded), unless the ranks
    disagree about which operations ran: then it is out of step until ``resync``. A lost member
    breaks every group holding it: destroy_process_group, then init again.
    """
    g = _member(group, "gather")
    root = _root(g, dst, "dst")
    inp = _tensors.as_array(tensor, arg="tensor", writable=False)
    outs = None
    if g.rank == root:
        if gather_list is None:
            raise DistValueError("gather: gather_list is required on the destination rank")
        outs = _tensor_list(gather_list, "gather_list", writable=True, length=g.size, like=inp)
    elif gather_list:
        raise DistValueError("gather: gather_list must not be given on ranks other than dst")
    ctx = g.next_op("gather", dtype=dtype_name(inp.dtype), count=inp.size, root=g.ranks[root])
    return launch(g, ctx, _gather(ctx, inp, outs, root), timeout)


@routed(tensor=OUT, scatter_list=IN)
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
    Raises:
        ValueError / TypeError (``DistValueError``, ``DistTypeError``): a bad argument (tensor,
            dtype, rank, list length), raised here at the call, before anything is sent.
        DistTimeoutError, DistNetworkError, CollectiveMismatchError: from awaiting the Work: the
            timeout ran out (naming the ranks that did not arrive), a member was lost, or members
            called different operations or with different sizes, dtypes or roots.

    A timeout abandons the operation on this rank only: its outputs may hold partial data, and
    the group goes on (stale messages of the operation are discarded), unless the ranks
    disagree about which operations ran: then it is out of step until ``resync``. A lost member
    breaks every group holding it: destroy_process_group, then init again.
    """
    g = _member(group, "scatter")
    root = _root(g, src, "src")
    out = _tensors.as_array(tensor, arg="tensor", writable=True)
    ins = None
    if g.rank == root:
        if scatter_list is None:
            raise DistValueError("scatter: scatter_list is required on the source rank")
        ins = _tensor_list(scatter_list, "scatter_list", writable=False, length=g.size, like=out)
    elif scatter_list:
        raise DistValueError("scatter: scatter_list must not be given on ranks other than src")
    ctx = g.next_op("scatter", dtype=dtype_name(out.dtype), count=out.size, root=g.ranks[root])
    return launch(g, ctx, _scatter(ctx, out, ins, root), timeout)


@routed(output=OUT, input_list=IN)
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
    Raises:
        ValueError / TypeError (``DistValueError``, ``DistTypeError``): a bad argument (tensor,
            dtype, rank, list length), raised here at the call, before anything is sent.
        DistTimeoutError, DistNetworkError, CollectiveMismatchError: from awaiting the Work: the
            timeout ran out (naming the ranks that did not arrive), a member was lost, or members
            called different operations or with different sizes, dtypes or roots.

    A timeout abandons the operation on this rank only: its outputs may hold partial data, and
    the group goes on (stale messages of the operation are discarded), unless the ranks
    disagree about which operations ran: then it is out of step until ``resync``. A lost member
    breaks every group holding it: destroy_process_group, then init again.
    """
    g = _member(group, "reduce_scatter")
    out = _tensors.as_array(output, arg="output", writable=True)
    ins = _tensor_list(input_list, "input_list", writable=False, length=g.size, like=out)
    rop = _reduce_op(op, out)
    ctx = g.next_op("reduce_scatter", dtype=dtype_name(out.dtype), count=out.size, redop=rop.name)
    return launch(g, ctx, _reduce_scatter(ctx, out, ins, rop), timeout)


@routed(output=OUT, input=IN)
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
    Raises:
        ValueError / TypeError (``DistValueError``, ``DistTypeError``): a bad argument (tensor,
            dtype, rank, list length), raised here at the call, before anything is sent.
        DistTimeoutError, DistNetworkError, CollectiveMismatchError: from awaiting the Work: the
            timeout ran out (naming the ranks that did not arrive), a member was lost, or members
            called different operations or with different sizes, dtypes or roots.

    A timeout abandons the operation on this rank only: its outputs may hold partial data, and
    the group goes on (stale messages of the operation are discarded), unless the ranks
    disagree about which operations ran: then it is out of step until ``resync``. A lost member
    breaks every group holding it: destroy_process_group, then init again.
    """
    g = _member(group, "reduce_scatter_tensor")
    out = _tensors.as_array(output, arg="output", writable=True)
    inp = _tensors.as_array(input, arg="input", writable=False)
    _same_dtype(out, inp, "output", "input")
    if inp.size != out.size * g.size:
        raise DistValueError(
            f"input has {inp.size} elements but must have group size x output's = {g.size} x {out.size}"
        )
    rop = _reduce_op(op, out)
    ctx = g.next_op("reduce_scatter_tensor", dtype=dtype_name(out.dtype), count=out.size, redop=rop.name)
    return launch(g, ctx, _reduce_scatter(ctx, out, _split(inp, g.size), rop), timeout)


reduce_scatter_single = reduce_scatter_tensor


@routed(output_tensor_list=OUT, input_tensor_list=IN)
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
    Raises:
        ValueError / TypeError (``DistValueError``, ``DistTypeError``): a bad argument (tensor,
            dtype, rank, list length), raised here at the call, before anything is sent.
        DistTimeoutError, DistNetworkError, CollectiveMismatchError: from awaiting the Work: the
            timeout ran out (naming the ranks that did not arrive), a member was lost, or members
            called different operations or with different sizes, dtypes or roots.

    A timeout abandons the operation on this rank only: its outputs may hold partial data, and
    the group goes on (stale messages of the operation are discarded), unless the ranks
    disagree about which operations ran: then it is out of step until ``resync``. A lost member
    breaks every group holding it: destroy_process_group, then init again.
    """
    g = _member(group, "all_to_all")
    ins = _tensor_list(
        input_tensor_list, "input_tensor_list", writable=False, length=g.size, like=None, same_size=False
    )
    outs = _tensor_list(
        output_tensor_list,
        "output_tensor_list",
        writable=True,
        length=g.size,
        like=ins[0] if ins else None,
        same_size=False,
    )
    if outs[g.rank].size != ins[g.rank].size:
        raise DistValueError(
            f"output_tensor_list[{g.rank}] has {outs[g.rank].size} elements but this rank's own block "
            f"input_tensor_list[{g.rank}] has {ins[g.rank].size}"
        )
    ctx = g.next_op("all_to_all", dtype=dtype_name(ins[0].dtype), count=-1)
    return launch(g, ctx, _alltoall(ctx, outs, ins), timeout)


def _splits(sizes: Any, arg: str, n: int, rows: int, tensor_arg: str) -> list[int]:
    if sizes is None or (isinstance(sizes, list | tuple) and len(sizes) == 0):
        if rows % n:
            raise DistValueError(
                f"{tensor_arg} has {rows} rows, which cannot be split evenly among {n} ranks; pass {arg}"
            )
        return [rows // n] * n
    if not isinstance(sizes, Sequence) or isinstance(sizes, str | bytes):
        raise DistTypeError(f"{arg} must be a list of ints, got {type(sizes).__qualname__}")
    out = []
    for i, s in enumerate(sizes):
        if isinstance(s, bool) or not hasattr(s, "__index__"):
            raise DistTypeError(f"{arg}[{i}] must be an int, got {type(s).__qualname__}")
        if int(s) < 0:
            raise DistValueError(f"{arg}[{i}] is negative ({int(s)})")
        out.append(int(s))
    if len(out) != n:
        raise DistValueError(f"{arg} must have one entry per group member ({n}), got {len(out)}")
    if sum(out) != rows:
        raise DistValueError(f"{arg} sums to {sum(out)} rows but {tensor_arg} has {rows} rows")
    return out


def _rows(obj: Any, arg: str) -> tuple[int, int]:
    """(rows along dim 0, elements per row) of a tensor."""
    _, numel, shape = _tensors.describe(obj, arg=arg)
    if not shape:
        return 1, numel
    per_row = 1
    for d in shape[1:]:
        per_row *= d
    return shape[0], per_row


def _cut(arr: Array, splits: list[int], per_row: int) -> list[Array]:
    blocks, start = [], 0
    for s in splits:
        blocks.append(arr[start : start + s * per_row])
        start += s * per_row
    return blocks


@routed(output=OUT, input=IN)
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
    Raises:
        ValueError / TypeError (``DistValueError``, ``DistTypeError``): a bad argument (tensor,
            dtype, rank, list length), raised here at the call, before anything is sent.
        DistTimeoutError, DistNetworkError, CollectiveMismatchError: from awaiting the Work: the
            timeout ran out (naming the ranks that did not arrive), a member was lost, or members
            called different operations or with different sizes, dtypes or roots.

    A timeout abandons the operation on this rank only: its outputs may hold partial data, and
    the group goes on (stale messages of the operation are discarded), unless the ranks
    disagree about which operations ran: then it is out of step until ``resync``. A lost member
    breaks every group holding it: destroy_process_group, then init again.
    """
    g = _member(group, "all_to_all_single")
    out = _tensors.as_array(output, arg="output", writable=True)
    inp = _tensors.as_array(input, arg="input", writable=False)
    _same_dtype(out, inp, "output", "input")
    in_rows, in_row = _rows(input, "input")
    out_rows, out_row = _rows(output, "output")
    isz = _splits(input_split_sizes, "input_split_sizes", g.size, in_rows, "input")
    osz = _splits(output_split_sizes, "output_split_sizes", g.size, out_rows, "output")
    ins, outs = _cut(inp, isz, in_row), _cut(out, osz, out_row)
    if outs[g.rank].size != ins[g.rank].size:
        raise DistValueError(
            f"this rank's own block is {ins[g.rank].size} elements in input but {outs[g.rank].size} in output"
        )
    ctx = g.next_op("all_to_all_single", dtype=dtype_name(inp.dtype), count=-1)
    return launch(g, ctx, _alltoall(ctx, outs, ins), timeout)
