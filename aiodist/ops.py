"""Reduction operators, the dtype rules they obey, and the numpy kernels that apply them.

Pure code: no I/O, no torch import. Every kernel is a numpy ufunc called with ``out=``, so a large
reduction releases the GIL and may run in a worker thread while the event loop keeps reading sockets.

Semantics, chosen to match what torch users get from gloo / NCCL:

* ``bool``: SUM and MAX are logical or, PRODUCT and MIN logical and, BXOR logical xor.
* integers wrap on overflow (two's complement), as numpy, gloo and NCCL do.
* AVG is SUM on the wire; :func:`finalize_inplace` then divides by the number of contributions.
  Integers divide truncating toward zero (NCCL's ``ncclAvg`` is a sum followed by C integer
  division); floats and complex numbers use true division of the full sum (one rounding at the end,
  where NCCL pre-multiplies each input by ``1/n``). AVG on ``bool`` is refused.
* Bitwise ops only on integers and bool; MIN/MAX not on complex.
* ``bfloat16`` is computed in float32 and rounded back, which is what ml_dtypes' own loops do, but
  through numpy's buffered casting: bounded scratch (one buffer of a few thousand elements) and
  about twice as fast as ml_dtypes' element-wise loops. ``float16`` uses numpy's native loops,
  which measured faster here than a float32 detour.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any, Final

import ml_dtypes
import numpy as np
import numpy.typing as npt

from .errors import DistTypeError, DistValueError, UnsupportedReduceError

__all__ = [
    "SUPPORTED_DTYPE_NAMES",
    "ReduceOp",
    "as_reduce_op",
    "check_reduce",
    "dtype_from_name",
    "dtype_name",
    "finalize_inplace",
    "reduce_inplace",
    "reduce_many",
    "reduce_op",
]


class ReduceOp(enum.Enum):
    """The reduction applied by ``all_reduce``, ``reduce`` and ``reduce_scatter``.

    Used like torch's: ``ReduceOp.SUM``. Values are torch's ``RedOpType`` numbers, so they can stand
    for the op in a wire header. ``ReduceOp(x)`` also accepts a member name (``"sum"``) and
    torch's own ``torch.distributed.ReduceOp`` values, by name.
    """

    SUM = 0
    AVG = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4
    BAND = 5
    BOR = 6
    BXOR = 7

    @classmethod
    def _missing_(cls, value: object) -> ReduceOp | None:
        # Called by ReduceOp(value) when value is not one of our numbers: try it as a name.
        name = _foreign_op_name(value)
        return cls.__members__.get(name) if name is not None else None


#: torch's old, deprecated spelling, kept because scripts still use it.
reduce_op = ReduceOp


def _foreign_op_name(value: object) -> str | None:
    """The upper-case op name carried by a string or a torch ReduceOp value, else None."""
    if isinstance(value, str):
        return value.upper()
    if type(value).__module__.startswith("torch"):
        # torch.distributed.ReduceOp instances wrap a RedOpType in ``.op``; RedOpType has ``.name``.
        inner = getattr(value, "op", value)
        name = getattr(inner, "name", None)
        if isinstance(name, str):
            return name.upper()
    return None


def as_reduce_op(op: object, *, arg: str = "op") -> ReduceOp:
    """Normalise ``op`` to a :class:`ReduceOp`.

    Args:
        op: a ``ReduceOp``, a member name such as ``"sum"``, or a ``torch.distributed.ReduceOp``
            value (matched by name; torch need not be imported for other inputs).
        arg: the argument name used in error messages.

    Returns:
        The ReduceOp member.

    Raises:
        DistValueError: a name that is no ReduceOp member, or torch's ``PREMUL_SUM``.
        DistTypeError: anything else.
    """
    if isinstance(op, ReduceOp):
        return op
    name = _foreign_op_name(op)
    if name is None:
        raise DistTypeError(f"{arg} must be a ReduceOp, got {type(op).__name__} {op!r}")
    member = ReduceOp.__members__.get(name)
    if member is None:
        if name == "PREMUL_SUM":
            raise DistValueError(f"{arg}: ReduceOp.PREMUL_SUM is not supported by aiodist")
        raise DistValueError(
            f"{arg}: unknown reduce op {op!r}; expected one of {', '.join(ReduceOp.__members__)}"
        )
    return member


# --------------------------------------------------------------------------------------------------
# dtypes

_BFLOAT16: Final = np.dtype(ml_dtypes.bfloat16)

_DTYPES: Final[dict[str, np.dtype[Any]]] = {
    "bool": np.dtype(np.bool_),
    "uint8": np.dtype(np.uint8),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "float16": np.dtype(np.float16),
    "bfloat16": _BFLOAT16,
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "complex64": np.dtype(np.complex64),
    "complex128": np.dtype(np.complex128),
}
_NAMES: Final[dict[np.dtype[Any], str]] = {dt: name for name, dt in _DTYPES.items()}

#: Canonical names of the supported dtypes (also torch's attribute names for them).
SUPPORTED_DTYPE_NAMES: Final[tuple[str, ...]] = tuple(_DTYPES)

_INTEGER: Final = frozenset({"uint8", "int8", "int16", "int32", "int64"})
_FLOAT: Final = frozenset({"float16", "bfloat16", "float32", "float64"})
_COMPLEX: Final = frozenset({"complex64", "complex128"})


def dtype_name(dtype: npt.DTypeLike) -> str:
    """The canonical name of a supported dtype: ``"float32"``, ``"bfloat16"``, ``"bool"``, ...

    Args:
        dtype: a numpy dtype, or anything ``numpy.dtype()`` accepts.

    Returns:
        The name, which is also the name of the matching ``torch`` dtype attribute.

    Raises:
        DistTypeError: the dtype is not one aiodist communicates (or is not in native byte order).
    """
    if dtype is None:
        # numpy reads None as float64; here it is always a caller's mistake.
        raise DistTypeError("not a dtype: None")
    try:
        dt = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
    except TypeError as exc:
        raise DistTypeError(f"not a dtype: {dtype!r}") from exc
    name = _NAMES.get(dt)
    if name is None:
        if not dt.isnative:
            # Equal-looking '>i4' is not int32 here: the wire carries native-order bytes only.
            raise DistTypeError(f"unsupported dtype {dt.str} (non-native byte order)")
        raise DistTypeError(f"unsupported dtype {dt}; supported: {', '.join(_DTYPES)}")
    return name


def dtype_from_name(name: str) -> np.dtype[Any]:
    """The numpy dtype for a canonical name produced by :func:`dtype_name`.

    Args:
        name: e.g. ``"bfloat16"``.

    Returns:
        The numpy dtype (``ml_dtypes.bfloat16`` for ``"bfloat16"``).

    Raises:
        DistTypeError: the name is not a supported dtype.
    """
    dt = _DTYPES.get(name) if isinstance(name, str) else None
    if dt is None:
        raise DistTypeError(f"unsupported dtype name {name!r}; supported: {', '.join(_DTYPES)}")
    return dt


# --------------------------------------------------------------------------------------------------
# op x dtype rules and kernels


def _refusal(op: ReduceOp, name: str) -> str | None:
    """Why ``op`` makes no sense on dtype ``name``, or None when it is allowed."""
    bitwise = op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
    if bitwise and (name in _FLOAT or name in _COMPLEX):
        return "bitwise reductions need an integer or bool dtype"
    if op in (ReduceOp.MIN, ReduceOp.MAX) and name in _COMPLEX:
        return "complex numbers have no order"
    if op is ReduceOp.AVG and name == "bool":
        return "the average of booleans is not a boolean"
    return None


def _ufunc_for(op: ReduceOp, name: str) -> np.ufunc:
    if name == "bool":
        # torch's convention for bool: SUM saturates to "any", PRODUCT is "all".
        if op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.BOR):
            return np.logical_or
        if op in (ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.BAND):
            return np.logical_and
        return np.logical_xor
    table: dict[ReduceOp, np.ufunc] = {
        ReduceOp.SUM: np.add,
        ReduceOp.AVG: np.add,  # divided once, at the end, by finalize_inplace
        ReduceOp.PRODUCT: np.multiply,
        ReduceOp.MIN: np.minimum,
        ReduceOp.MAX: np.maximum,
        ReduceOp.BAND: np.bitwise_and,
        ReduceOp.BOR: np.bitwise_or,
        ReduceOp.BXOR: np.bitwise_xor,
    }
    return table[op]


class _Kernel:
    """One (op, dtype) reduction: the ufunc, and the dtype to compute in (None: the array's own)."""

    __slots__ = ("compute", "quiet", "ufunc")

    def __init__(self, op: ReduceOp, name: str) -> None:
        self.ufunc: np.ufunc = _ufunc_for(op, name)
        self.compute: np.dtype[Any] | None = np.dtype(np.float32) if name == "bfloat16" else None
        # Floating-point overflow or NaN in user data is the user's business, as in torch; numpy
        # would print RuntimeWarnings from inside the library. Integers never warn in ufuncs.
        self.quiet: bool = name in _FLOAT or name in _COMPLEX

    def __call__(self, acc: npt.NDArray[Any], other: npt.NDArray[Any]) -> None:
        if self.quiet:
            with np.errstate(all="ignore"):
                self._apply(acc, other)
        else:
            self._apply(acc, other)

    def _apply(self, acc: npt.NDArray[Any], other: npt.NDArray[Any]) -> None:
        if self.compute is None:
            self.ufunc(acc, other, out=acc)
        else:
            # numpy casts in buffer-sized chunks here: no array-sized temporary.
            self.ufunc(acc, other, out=acc, dtype=self.compute, casting="unsafe")


_KERNELS: Final[dict[tuple[ReduceOp, str], _Kernel]] = {
    (op, name): _Kernel(op, name) for op in ReduceOp for name in _DTYPES if _refusal(op, name) is None
}


def check_reduce(op: object, dtype: npt.DTypeLike) -> ReduceOp:
    """Validate that ``op`` can reduce arrays of ``dtype``; normalise ``op``.

    Args:
        op: anything :func:`as_reduce_op` accepts.
        dtype: the dtype of the data to reduce.

    Returns:
        The ReduceOp member.

    Raises:
        DistTypeError: unsupported dtype.
        UnsupportedReduceError: a combination that makes no sense (bitwise on float/complex,
            MIN/MAX on complex, AVG on bool; a ``TypeError`` and a ``ValueError``); the message
            names op and dtype.
        DistValueError: an unknown op name.
    """
    rop = as_reduce_op(op)
    name = dtype_name(dtype)
    why = _refusal(rop, name)
    if why is not None:
        raise UnsupportedReduceError(f"ReduceOp.{rop.name} is not supported for {name} tensors: {why}")
    return rop


def _kernel(op: object, acc: npt.NDArray[Any], other: npt.NDArray[Any]) -> _Kernel:
    # The common case in one lookup (a third of a 4 B all_reduce's reduction time went to
    # re-validating what the operation checked when it started); anything odd takes the
    # checking path below, which names the problem.
    if (
        type(op) is ReduceOp
        and other.dtype == acc.dtype
        and other.shape == acc.shape
        and acc.flags.writeable
        and (kernel := _KERNELS.get((op, _NAMES.get(acc.dtype, "")))) is not None
    ):
        return kernel
    rop = check_reduce(op, acc.dtype)
    if other.dtype != acc.dtype:
        raise DistTypeError(
            f"cannot reduce {dtype_name(other.dtype)} into {dtype_name(acc.dtype)} with ReduceOp.{rop.name}: "
            "dtypes differ"
        )
    if other.shape != acc.shape:
        raise DistValueError(
            f"cannot reduce shape {other.shape} into shape {acc.shape} with ReduceOp.{rop.name}"
        )
    if not acc.flags.writeable:
        raise DistValueError("the accumulator of a reduction is read-only")
    return _KERNELS[rop, _NAMES[acc.dtype]]


def reduce_inplace(op: object, acc: npt.NDArray[Any], other: npt.NDArray[Any]) -> None:
    """``acc = acc (op) other``, element-wise, in place, without array-sized temporaries.

    Safe to call from a worker thread: numpy releases the GIL for these loops. For AVG this adds;
    call :func:`finalize_inplace` once all contributions are in.

    Args:
        op: the reduction (anything :func:`as_reduce_op` accepts).
        acc: the accumulator; overwritten.
        other: the operand; same dtype and shape as ``acc`` (numpy copes with overlap).

    Raises:
        DistTypeError: op/dtype mismatch (see :func:`check_reduce`) or differing dtypes.
        DistValueError: differing shapes, or ``acc`` is read-only.
    """
    _kernel(op, acc, other)(acc, other)


def reduce_many(op: object, out: npt.NDArray[Any], arrays: Iterable[npt.NDArray[Any]]) -> None:
    """Fold each of ``arrays`` into ``out`` in order: ``out = out (op) a0 (op) a1 ...``.

    ``out``'s current contents are the first operand; copy the first input into it beforehand to
    get the plain reduction of ``arrays``. AVG is not finalised here.

    Args:
        op: the reduction.
        out: the accumulator; overwritten.
        arrays: operands with ``out``'s dtype and shape.

    Raises:
        DistTypeError, DistValueError: as :func:`reduce_inplace`; arrays before the offending one
            have already been folded in.
    """
    for other in arrays:
        reduce_inplace(op, out, other)


_DIV_CHUNK: Final = 1 << 16


def finalize_inplace(op: object, arr: npt.NDArray[Any], count: int) -> None:
    """Finish a reduction: for AVG divide ``arr`` by ``count`` in place; no-op for other ops.

    Integers divide truncating toward zero (like NCCL's ``ncclAvg``), floats and complex numbers
    use true division (float16 and bfloat16 computed in float32).

    Args:
        op: the reduction that produced ``arr``.
        arr: the reduced data; overwritten.
        count: how many contributions were summed (the group size), at least 1.

    Raises:
        DistValueError: ``count`` < 1, or ``arr`` is read-only.
        DistTypeError: op/dtype mismatch (see :func:`check_reduce`).
    """
    rop = check_reduce(op, arr.dtype)
    if isinstance(count, bool) or not isinstance(count, int | np.integer) or count < 1:
        raise DistValueError(f"count must be a positive int, got {count!r}")
    if rop is not ReduceOp.AVG or count == 1:
        return
    if not arr.flags.writeable:
        raise DistValueError("the array to finalize is read-only")
    name = _NAMES[arr.dtype]
    if name in _INTEGER:
        if arr.flags.c_contiguous:
            _trunc_divide(arr.reshape(-1), int(count))
        else:
            # Not a path the collectives take (they hand over flat views); correct, not fast.
            flat = arr.flatten()
            _trunc_divide(flat, int(count))
            np.copyto(arr, flat.reshape(arr.shape))
        return
    with np.errstate(all="ignore"):
        if name in ("float16", "bfloat16"):
            np.divide(arr, np.float32(count), out=arr, dtype=np.float32, casting="unsafe")
        else:
            # A Python int is converted to arr's own (real or complex) dtype, exact below 2**24.
            np.divide(arr, int(count), out=arr)


def _trunc_divide(flat: npt.NDArray[Any], n: int) -> None:
    """``flat = trunc(flat / n)`` for integer data, exactly, in chunks of bounded scratch.

    numpy's floor_divide rounds toward -inf; for negative x, trunc(x/n) == floor((x + n - 1) / n),
    and x + n - 1 cannot overflow int64 for x < 0. Narrow ints are widened to int64 per chunk so
    that ``n`` need not fit their range (world sizes above 127 with int8 data).
    """
    size = flat.size
    if size == 0:
        return
    step = min(size, _DIV_CHUNK)
    wide = flat.dtype == np.int64
    scratch = None if wide else np.empty(step, dtype=np.int64)
    negative = np.empty(step, dtype=np.bool_)
    divisor = np.int64(n)
    bias = np.int64(n - 1)
    for start in range(0, size, step):
        part = flat[start : start + step]
        k = part.size
        work = part if scratch is None else scratch[:k]
        if scratch is not None:
            np.copyto(work, part)
        mask = np.less(work, 0, out=negative[:k])
        np.add(work, bias, out=work, where=mask)
        np.floor_divide(work, divisor, out=work)
        if scratch is not None:
            # |quotient| <= |dividend|, so the narrowing cast is exact.
            np.copyto(part, work, casting="unsafe")
