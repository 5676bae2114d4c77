"""The argument checks of every tensor collective: the caller's arguments -> an ``Op``.

Each function checks one operation's arguments as the async face documents them, asking the
group's backend binding for each tensor (``Binding.tensor``: a flat host array), and returns
what the group needs to number and start it (``Checked``). Nothing is sent, and the group's
numbering is untouched, until every check passed.

Fingerprint counts: the element count of the tensor every rank passes with the same size
(``tensor``; ``all_gather``: the input; ``gather``: the input; ``scatter``/``reduce_scatter``:
the output). ``all_to_all`` blocks may legitimately differ per pair, so their count is -1 and
each receive's exact byte check catches sizes that disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from aiodist import _tensors
from aiodist.backends.base import IN, INOUT, OUT, Binding, Op
from aiodist.errors import DistTypeError, DistValueError
from aiodist.ops import check_reduce, dtype_name

__all__ = [
    "Checked",
    "Members",
    "OneDevice",
    "check_device",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
]


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


# -- device rules (a backend's binding applies them to each tensor it is shown) ---------------------

#: The kind of device each backend on torch's engine runs, and what to do with a tensor elsewhere.
_ENGINE_DEVICES = {
    "nccl": ("cuda", "CUDA tensors only: move it to this rank's GPU (tensor.cuda()), or use backend 'tcp'"),
    "torch-gloo": (
        "cpu",
        "CPU tensors only: use backend 'nccl' for CUDA tensors, or 'tcp' (which stages them through host memory)",
    ),
}


def check_device(backend: str, arg: str, device_type: str, where: str) -> None:
    """Refuse a tensor on a device of type ``device_type`` (``where``: as the message names it)
    if the engine of ``backend`` ("nccl", "torch-gloo") does not run that kind of device.

    Raises:
        DistValueError: naming ``arg``, the device and what to use instead.
    """
    wanted, rule = _ENGINE_DEVICES[backend]
    if device_type != wanted:
        raise DistValueError(f"{arg} is on {where}, but backend {backend!r} runs {rule}")


class OneDevice:
    """All the tensors of one call are on one device: a binding keeps one per call and shows it
    each tensor's device (``check``) as the group's checks ask for the tensor."""

    __slots__ = ("first",)

    def __init__(self) -> None:
        self.first: tuple[str, str] | None = None

    def check(self, arg: str, device: str) -> None:
        """Raises DistValueError if ``arg``'s ``device`` is not the first tensor's."""
        if self.first is None:
            self.first = (arg, device)
        elif device != self.first[1]:
            raise DistValueError(
                f"the tensors of one call must be on one device: {self.first[0]} is on {self.first[1]} "
                f"but {arg} is on {device}"
            )


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


def _split(arr: Array, n: int) -> tuple[Array, ...]:
    b = arr.size // n
    return tuple(arr[i * b : (i + 1) * b] for i in range(n))


def broadcast(g: Members, b: Binding, tensor: Any, src: int) -> Checked:
    root = g.group_rank(src, "src")
    arr = b.tensor(tensor, arg="tensor", role=INOUT, writable=g.rank != root)
    return Checked(Op("broadcast", (arr,), root=root), dtype_name(arr.dtype), arr.size)


def all_reduce(g: Members, b: Binding, tensor: Any, op: Any) -> Checked:
    arr = b.tensor(tensor, arg="tensor", role=INOUT, writable=True)
    rop = check_reduce(op, arr.dtype)
    return Checked(Op("all_reduce", (arr,), reduce_op=rop), dtype_name(arr.dtype), arr.size)


def reduce(g: Members, b: Binding, tensor: Any, dst: int, op: Any) -> Checked:
    root = g.group_rank(dst, "dst")
    arr = b.tensor(tensor, arg="tensor", role=INOUT, writable=g.rank == root)
    rop = check_reduce(op, arr.dtype)
    return Checked(Op("reduce", (arr,), root=root, reduce_op=rop), dtype_name(arr.dtype), arr.size)


def all_gather(g: Members, b: Binding, tensor_list: Any, tensor: Any) -> Checked:
    inp = b.tensor(tensor, arg="tensor", role=IN, writable=False)
    outs = _tensor_list(b, tensor_list, "tensor_list", writable=True, length=g.size, like=inp)
    return Checked(Op("all_gather", tuple(outs), (inp,)), dtype_name(inp.dtype), inp.size)


def all_gather_into_tensor(g: Members, b: Binding, output_tensor: Any, input_tensor: Any) -> Checked:
    inp = b.tensor(input_tensor, arg="input_tensor", role=IN, writable=False)
    out = b.tensor(output_tensor, arg="output_tensor", role=OUT, writable=True)
    _same_dtype(out, inp, "output_tensor", "input_tensor")
    if out.size != inp.size * g.size:
        raise DistValueError(
            f"output_tensor has {out.size} elements but must have group size x input_tensor's = "
            f"{g.size} x {inp.size}"
        )
    return Checked(Op("all_gather", _split(out, g.size), (inp,)), dtype_name(inp.dtype), inp.size)


def gather(g: Members, b: Binding, tensor: Any, gather_list: Any, dst: int) -> Checked:
    root = g.group_rank(dst, "dst")
    inp = b.tensor(tensor, arg="tensor", role=IN, writable=False)
    outs: list[Array] = []
    if g.rank == root:
        if gather_list is None:
            raise DistValueError("gather: gather_list is required on the destination rank")
        outs = _tensor_list(b, gather_list, "gather_list", writable=True, length=g.size, like=inp)
    elif gather_list:
        raise DistValueError("gather: gather_list must not be given on ranks other than dst")
    return Checked(Op("gather", tuple(outs), (inp,), root=root), dtype_name(inp.dtype), inp.size)


def scatter(g: Members, b: Binding, tensor: Any, scatter_list: Any, src: int) -> Checked:
    root = g.group_rank(src, "src")
    out = b.tensor(tensor, arg="tensor", role=OUT, writable=True)
    ins: list[Array] = []
    if g.rank == root:
        if scatter_list is None:
            raise DistValueError("scatter: scatter_list is required on the source rank")
        ins = _tensor_list(b, scatter_list, "scatter_list", writable=False, length=g.size, like=out)
    elif scatter_list:
        raise DistValueError("scatter: scatter_list must not be given on ranks other than src")
    return Checked(Op("scatter", (out,), tuple(ins), root=root), dtype_name(out.dtype), out.size)


def reduce_scatter(g: Members, b: Binding, output: Any, input_list: Any, op: Any) -> Checked:
    out = b.tensor(output, arg="output", role=OUT, writable=True)
    ins = _tensor_list(b, input_list, "input_list", writable=False, length=g.size, like=out)
    rop = check_reduce(op, out.dtype)
    return Checked(Op("reduce_scatter", (out,), tuple(ins), reduce_op=rop), dtype_name(out.dtype), out.size)


def reduce_scatter_tensor(g: Members, b: Binding, output: Any, input: Any, op: Any) -> Checked:
    out = b.tensor(output, arg="output", role=OUT, writable=True)
    inp = b.tensor(input, arg="input", role=IN, writable=False)
    _same_dtype(out, inp, "output", "input")
    if inp.size != out.size * g.size:
        raise DistValueError(
            f"input has {inp.size} elements but must have group size x output's = {g.size} x {out.size}"
        )
    rop = check_reduce(op, out.dtype)
    op_ = Op("reduce_scatter", (out,), _split(inp, g.size), reduce_op=rop)
    return Checked(op_, dtype_name(out.dtype), out.size)


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


def all_to_all_single(
    g: Members, b: Binding, output: Any, input: Any, output_split_sizes: Any, input_split_sizes: Any
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
    return Checked(Op("all_to_all", outs, ins), dtype_name(inp.dtype), -1)
