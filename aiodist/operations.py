"""The operation table: every tensor collective declared once.

An entry (``Operation``) names the operation, checks its arguments as the async face documents
them and says how the blocking face shows it to torch's profiler. Its check asks the group's
backend binding for each tensor (``Binding.tensor``: a flat host array) and returns what the
group needs to number and start it (``Checked``: the ``Op`` and its fingerprint's dtype and
count). Nothing is sent, and the group's numbering is untouched, until every check passed.

The group runs any entry by name (``ProcessGroup.collective``); the planner
(``aiodist.backends.native.algorithm``) picks the algorithm of its ``Op``'s kind. The async face
(``aiodist.face.tensor_collectives``) and the blocking face (``aiodist.sync._collectives``) hold
one declaration each per entry (the signature and docstring users read), whose body runs the
entry by name. So an operation over an existing kind of collective is three declarations: here
and on each face; a new kind adds its algorithm (``collectives/``) and its line in ``KINDS``
here (``tests/unit/test_operation_table.py`` keeps the count).

Fingerprint counts: the element count of the tensor every rank passes with the same size
(``tensor``; ``all_gather``: the input; ``gather``: the input; ``scatter``/``reduce_scatter``:
the output). ``all_to_all`` blocks may legitimately differ per pair, so their count is -1 and
each receive's exact byte check catches sizes that disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from aiodist import _tensors
from aiodist.backends.base import IN, INOUT, OUT, Binding, Op
from aiodist.collectives import hostaware
from aiodist.collectives.allgather import allgather
from aiodist.collectives.allreduce import allreduce
from aiodist.collectives.alltoall import alltoall
from aiodist.collectives.barrier import barrier_steps
from aiodist.collectives.broadcast import broadcast as broadcast_plan
from aiodist.collectives.context import OpContext
from aiodist.collectives.gather import gather as gather_plan
from aiodist.collectives.gather import scatter as scatter_plan
from aiodist.collectives.reduce import reduce as reduce_plan
from aiodist.collectives.reduce_scatter import reduce_scatter as reduce_scatter_plan
from aiodist.collectives.steps import Plan
from aiodist.errors import DistTypeError, DistValueError
from aiodist.ops import ReduceOp, check_reduce, dtype_name

__all__ = ["KINDS", "TABLE", "Checked", "Kind", "Members", "Operation", "operation", "operation_named"]


class Members(Protocol):
    """What the checks need of a group (``aiodist.group.ProcessGroup`` is one): its size, this
    rank's place in it, and the group rank of a global one."""

    rank: int
    size: int

    def group_rank(self, global_rank: int, arg: str = "rank") -> int: ...


Array = Any  # a flat numpy view


class Checked(NamedTuple):
    """A collective whose arguments passed: the ``Op`` and its fingerprint's dtype and element count."""

    op: Op
    dtype: str
    numel: int


#: ``check(group, binding, *arguments)``: the checked call, or a DistTypeError/DistValueError.
Check = Callable[..., Checked]


class Operation(NamedTuple):
    """One entry of the table.

    Attributes:
        name: the operation's name on both faces ("reduce_scatter_tensor").
        check: its argument checks (the face's arguments after ``group``, before ``timeout``).
        record: the name torch's profiler records for it, as gloo's backend names it
            ("_reduce_scatter_base"); the blocking face prefixes the backend ("gloo:").
        tensors: how many of its leading arguments are tensors or tensor lists (the blocking
            face runs a call with non-contiguous ones on contiguous copies).
        shown: the position, among those, of the input the profiler's record shows (None:
            every tensor).
    """

    name: str
    check: Check
    record: str
    tensors: int
    shown: int | None


#: Every tensor collective, by name.
TABLE: dict[str, Operation] = {}


def operation(
    *, record: str | None = None, tensors: int = 1, shown: int | None = None
) -> Callable[[Check], Check]:
    """Declare the operation whose check is the decorated function (named as the operation)."""

    def declare(check: Check) -> Check:
        name = check.__name__
        TABLE[name] = Operation(name, check, record or name, tensors, shown)
        return check

    return declare


def operation_named(name: str) -> Operation:
    """The table's entry ``name``.

    Raises:
        DistValueError: no tensor collective is called ``name``.
    """
    try:
        return TABLE[name]
    except KeyError:
        raise DistValueError(f"no tensor collective is called {name!r} (known: {', '.join(TABLE)})") from None


# -- the kinds of collective: how aiodist's own backend plans each --------------------------------


class Kind(NamedTuple):
    """How the native backend plans one kind of ``Op`` (``aiodist.backends.native.algorithm``).

    Attributes:
        flat: its flat plan (the dispatcher picks its variant by size: ``select``).
        host: its host-aware plan for ``select.host_algorithm``'s choice ("direct",
            "hierarchical", "two-level"), or None: it has none.
        host_bytes: the size ``select.host_algorithm`` weighs for it (with ``host``).
    """

    flat: Callable[[OpContext, Op], Plan]
    host: Callable[[OpContext, Op, str], Plan] | None = None
    host_bytes: Callable[[OpContext, Op], int] = lambda ctx, op: 0


def _first_output_bytes(ctx: OpContext, op: Op) -> int:
    return int(op.outputs[0].nbytes)


_SUM = ReduceOp.SUM

#: Every kind of ``Op``, by name (the planner calls one of these per operation).
KINDS: dict[str, Kind] = {
    "barrier": Kind(
        lambda ctx, op: barrier_steps(ctx),
        lambda ctx, op, how: hostaware.barrier(ctx, how),
    ),
    "broadcast": Kind(
        lambda ctx, op: broadcast_plan(ctx, op.outputs[0], op.root),
        lambda ctx, op, how: hostaware.broadcast(ctx, op.outputs[0], op.root, how),
        _first_output_bytes,
    ),
    "all_reduce": Kind(
        lambda ctx, op: allreduce(ctx, op.outputs[0], op.reduce_op or _SUM),
        lambda ctx, op, how: hostaware.allreduce(ctx, op.outputs[0], op.reduce_op or _SUM, how),
        _first_output_bytes,
    ),
    "reduce": Kind(
        lambda ctx, op: reduce_plan(ctx, op.outputs[0], op.reduce_op or _SUM, op.root),
        lambda ctx, op, how: hostaware.reduce(ctx, op.outputs[0], op.reduce_op or _SUM, op.root, how),
        _first_output_bytes,
    ),
    "all_gather": Kind(
        lambda ctx, op: allgather(ctx, list(op.outputs), op.inputs[0]),
        lambda ctx, op, how: hostaware.allgather(ctx, list(op.outputs), op.inputs[0], how),
        # (the largest block: equal on every rank, as blocks may differ in size)
        lambda ctx, op: max(int(b.nbytes) for b in op.outputs),
    ),
    "gather": Kind(lambda ctx, op: gather_plan(ctx, op.inputs[0], list(op.outputs) or None, op.root)),
    "scatter": Kind(lambda ctx, op: scatter_plan(ctx, op.outputs[0], list(op.inputs) or None, op.root)),
    "reduce_scatter": Kind(
        lambda ctx, op: reduce_scatter_plan(ctx, op.outputs[0], list(op.inputs), op.reduce_op or _SUM),
        lambda ctx, op, how: hostaware.reduce_scatter(
            ctx, op.outputs[0], list(op.inputs), op.reduce_op or _SUM, how
        ),
        lambda ctx, op: int(op.outputs[0].nbytes) * ctx.size,
    ),
    "all_to_all": Kind(lambda ctx, op: alltoall(ctx, list(op.outputs), list(op.inputs))),
}


# -- the checks -------------------------------------------------------------------------------------


def _tensor_list(
    b: Binding,
    objs: Any,
    arg: str,
    *,
    writable: bool,
    length: int,
    like: Array | None,
    same_size: bool = True,
) -> list[Array]:
    """Views of a tensor list of ``length`` items sharing ``like``'s dtype (and size)."""
    if not isinstance(objs, list | tuple):
        raise DistTypeError(f"{arg} must be a list of tensors, got {type(objs).__qualname__}")
    if len(objs) != length:
        raise DistValueError(f"{arg} must have one tensor per group member ({length}), got {len(objs)}")
    role = OUT if writable else IN
    arrs = [b.tensor(o, arg=f"{arg}[{i}]", role=role, writable=writable) for i, o in enumerate(objs)]
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


def _blocks(g: Members, whole: Array, part: Array, whole_arg: str, part_arg: str) -> tuple[Array, ...]:
    """``whole`` (one buffer holding a block per member) split into its blocks, after checking
    that it matches ``part`` (one member's block) in dtype and holds exactly ``g.size`` of it."""
    _same_dtype(whole, part, whole_arg, part_arg)
    if whole.size != part.size * g.size:
        raise DistValueError(
            f"{whole_arg} has {whole.size} elements but must have group size x {part_arg}'s = "
            f"{g.size} x {part.size}"
        )
    return _split(whole, g.size)


def _split(arr: Array, n: int) -> tuple[Array, ...]:
    b = arr.size // n
    return tuple(arr[i * b : (i + 1) * b] for i in range(n))


_BARRIER = Checked(Op("barrier"), "", 0)


@operation(tensors=0)
def barrier(g: Members, b: Binding) -> Checked:
    return _BARRIER


@operation()
def broadcast(g: Members, b: Binding, tensor: Any, src: int) -> Checked:
    root = g.group_rank(src, "src")
    arr = b.tensor(tensor, arg="tensor", role=INOUT, writable=g.rank != root)
    return Checked(Op("broadcast", (arr,), root=root), dtype_name(arr.dtype), arr.size)


@operation()
def all_reduce(g: Members, b: Binding, tensor: Any, op: Any = ReduceOp.SUM) -> Checked:
    arr = b.tensor(tensor, arg="tensor", role=INOUT, writable=True)
    rop = check_reduce(op, arr.dtype)
    return Checked(Op("all_reduce", (arr,), reduce_op=rop), dtype_name(arr.dtype), arr.size)


@operation()
def reduce(g: Members, b: Binding, tensor: Any, dst: int, op: Any = ReduceOp.SUM) -> Checked:
    root = g.group_rank(dst, "dst")
    arr = b.tensor(tensor, arg="tensor", role=INOUT, writable=g.rank == root)
    rop = check_reduce(op, arr.dtype)
    return Checked(Op("reduce", (arr,), root=root, reduce_op=rop), dtype_name(arr.dtype), arr.size)


@operation(tensors=2, shown=1)
def all_gather(g: Members, b: Binding, tensor_list: Any, tensor: Any) -> Checked:
    inp = b.tensor(tensor, arg="tensor", role=IN, writable=False)
    outs = _tensor_list(b, tensor_list, "tensor_list", writable=True, length=g.size, like=inp)
    return Checked(Op("all_gather", tuple(outs), (inp,)), dtype_name(inp.dtype), inp.size)


@operation(record="_allgather_base", tensors=2, shown=1)
def all_gather_into_tensor(g: Members, b: Binding, output_tensor: Any, input_tensor: Any) -> Checked:
    inp = b.tensor(input_tensor, arg="input_tensor", role=IN, writable=False)
    out = b.tensor(output_tensor, arg="output_tensor", role=OUT, writable=True)
    outs = _blocks(g, out, inp, "output_tensor", "input_tensor")
    return Checked(Op("all_gather", outs, (inp,), whole=True), dtype_name(inp.dtype), inp.size)


_ROOT_WORDS = {"dst": "destination", "src": "source"}


def _root_list(
    g: Members, b: Binding, objs: Any, arg: str, root: int, like: Array, *, writable: bool, root_arg: str
) -> list[Array]:
    """The tensor list ``arg`` ("gather_list") of the operation rooted at ``root``: one tensor
    per member on the root, which must give it; none on the other ranks (``root_arg``: the
    root's argument, "dst" or "src", as the messages name it)."""
    what = arg.removesuffix("_list")
    if g.rank != root:
        if objs:
            raise DistValueError(f"{what}: {arg} must not be given on ranks other than {root_arg}")
        return []
    if objs is None:
        raise DistValueError(f"{what}: {arg} is required on the {_ROOT_WORDS[root_arg]} rank")
    return _tensor_list(b, objs, arg, writable=writable, length=g.size, like=like)


@operation(tensors=2, shown=0)
def gather(g: Members, b: Binding, tensor: Any, gather_list: Any = None, dst: int = 0) -> Checked:
    root = g.group_rank(dst, "dst")
    inp = b.tensor(tensor, arg="tensor", role=IN, writable=False)
    outs = _root_list(g, b, gather_list, "gather_list", root, inp, writable=True, root_arg="dst")
    return Checked(Op("gather", tuple(outs), (inp,), root=root), dtype_name(inp.dtype), inp.size)


@operation(tensors=2, shown=1)
def scatter(g: Members, b: Binding, tensor: Any, scatter_list: Any = None, src: int = 0) -> Checked:
    root = g.group_rank(src, "src")
    out = b.tensor(tensor, arg="tensor", role=OUT, writable=True)
    ins = _root_list(g, b, scatter_list, "scatter_list", root, out, writable=False, root_arg="src")
    return Checked(Op("scatter", (out,), tuple(ins), root=root), dtype_name(out.dtype), out.size)


@operation(tensors=2, shown=1)
def reduce_scatter(g: Members, b: Binding, output: Any, input_list: Any, op: Any = ReduceOp.SUM) -> Checked:
    out = b.tensor(output, arg="output", role=OUT, writable=True)
    ins = _tensor_list(b, input_list, "input_list", writable=False, length=g.size, like=out)
    rop = check_reduce(op, out.dtype)
    return Checked(Op("reduce_scatter", (out,), tuple(ins), reduce_op=rop), dtype_name(out.dtype), out.size)


@operation(record="_reduce_scatter_base", tensors=2, shown=1)
def reduce_scatter_tensor(g: Members, b: Binding, output: Any, input: Any, op: Any = ReduceOp.SUM) -> Checked:
    out = b.tensor(output, arg="output", role=OUT, writable=True)
    inp = b.tensor(input, arg="input", role=IN, writable=False)
    ins = _blocks(g, inp, out, "input", "output")
    rop = check_reduce(op, out.dtype)
    return Checked(
        Op("reduce_scatter", (out,), ins, reduce_op=rop, whole=True), dtype_name(out.dtype), out.size
    )


@operation(tensors=2, shown=1)
def all_to_all(g: Members, b: Binding, output_tensor_list: Any, input_tensor_list: Any) -> Checked:
    ins = _tensor_list(
        b, input_tensor_list, "input_tensor_list", writable=False, length=g.size, like=None, same_size=False
    )
    outs = _tensor_list(
        b,
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
    return Checked(Op("all_to_all", tuple(outs), tuple(ins)), dtype_name(ins[0].dtype), -1)


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


def _cut(arr: Array, splits: list[int], per_row: int) -> tuple[Array, ...]:
    blocks, start = [], 0
    for s in splits:
        blocks.append(arr[start : start + s * per_row])
        start += s * per_row
    return tuple(blocks)


@operation(record="alltoall_base", tensors=2, shown=1)
def all_to_all_single(
    g: Members,
    b: Binding,
    output: Any,
    input: Any,
    output_split_sizes: Any = None,
    input_split_sizes: Any = None,
) -> Checked:
    out = b.tensor(output, arg="output", role=OUT, writable=True)
    inp = b.tensor(input, arg="input", role=IN, writable=False)
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
    return Checked(Op("all_to_all", outs, ins, whole=True), dtype_name(inp.dtype), -1)
