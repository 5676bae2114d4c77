"""aiodist.ops: ReduceOp, dtype rules and reduction kernels, against references computed in Python."""

from __future__ import annotations

import functools
import math
import subprocess
import sys
import threading
import zlib
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodist.errors import DistError, DistTypeError, DistValueError
from aiodist.ops import (
    SUPPORTED_DTYPE_NAMES,
    ReduceOp,
    as_reduce_op,
    check_reduce,
    dtype_from_name,
    dtype_name,
    finalize_inplace,
    reduce_inplace,
    reduce_many,
    reduce_op,
)

INTS = ["uint8", "int8", "int16", "int32", "int64"]
FLOATS = ["float16", "bfloat16", "float32", "float64"]
COMPLEX = ["complex64", "complex128"]
ALL = ["bool", *INTS, *FLOATS, *COMPLEX]
BITWISE = {ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR}


def allowed(op: ReduceOp, name: str) -> bool:
    """The rule of SPEC §4, restated independently of the implementation."""
    if op in BITWISE:
        return name == "bool" or name in INTS
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        return name not in COMPLEX
    if op is ReduceOp.AVG:
        return name != "bool"
    return True


ALLOWED = [(op, n) for op in ReduceOp for n in ALL if allowed(op, n)]
REFUSED = [(op, n) for op in ReduceOp for n in ALL if not allowed(op, n)]


def make_inputs(name: str, count: int, size: int, seed: int) -> list[npt.NDArray[Any]]:
    rng = np.random.default_rng(seed)
    dt = dtype_from_name(name)
    out = []
    for _ in range(count):
        if name == "bool":
            a = rng.random(size) < 0.5
        elif name in INTS:
            info = np.iinfo(dt)
            a = rng.integers(info.min, info.max, size=size, endpoint=True, dtype=dt)
        elif name in FLOATS:
            a = (rng.standard_normal(size) * 3).astype(dt)
        else:
            a = (rng.standard_normal(size) + 1j * rng.standard_normal(size)).astype(dt)
        out.append(np.ascontiguousarray(a, dtype=dt))
    return out


def wrap(value: int, name: str) -> int:
    """Two's-complement wrap of an exact Python int into dtype ``name``."""
    bits = np.dtype(name).itemsize * 8
    value &= (1 << bits) - 1
    if name != "uint8" and value >= 1 << (bits - 1):
        value -= 1 << bits
    return value


def py_op(op: ReduceOp, name: str) -> Any:
    """The element-wise binary function on Python scalars, plus rounding to the dtype."""
    if name == "bool":
        return {
            ReduceOp.SUM: lambda a, b: a or b,
            ReduceOp.MAX: lambda a, b: a or b,
            ReduceOp.BOR: lambda a, b: a or b,
            ReduceOp.PRODUCT: lambda a, b: a and b,
            ReduceOp.MIN: lambda a, b: a and b,
            ReduceOp.BAND: lambda a, b: a and b,
            ReduceOp.BXOR: lambda a, b: a != b,
        }[op]
    table: dict[ReduceOp, Callable[[Any, Any], Any]] = {
        ReduceOp.SUM: lambda a, b: a + b,
        ReduceOp.AVG: lambda a, b: a + b,
        ReduceOp.PRODUCT: lambda a, b: a * b,
        ReduceOp.MIN: min,
        ReduceOp.MAX: max,
        ReduceOp.BAND: lambda a, b: a & b,
        ReduceOp.BOR: lambda a, b: a | b,
        ReduceOp.BXOR: lambda a, b: a ^ b,
    }
    base = table[op]
    if name in INTS:
        return lambda a, b: wrap(base(a, b), name)
    dt = dtype_from_name(name)
    if name in COMPLEX:
        return lambda a, b: complex(np.array(base(complex(a), complex(b))).astype(dt))
    # Exact in float64, then one rounding to the dtype: each step of the fold rounds once.
    return lambda a, b: float(np.float64(base(float(a), float(b))).astype(dt))


def to_py(a: npt.NDArray[Any], name: str) -> list[Any]:
    if name == "bool":
        return [bool(x) for x in a]
    if name in INTS:
        return [int(x) for x in a]
    if name in COMPLEX:
        return [complex(x) for x in a]
    return [float(x) for x in a]


def reference(op: ReduceOp, name: str, inputs: list[npt.NDArray[Any]]) -> list[Any]:
    f = py_op(op, name)
    cols = zip(*(to_py(a, name) for a in inputs), strict=True)
    return [functools.reduce(f, col) for col in cols]


def assert_matches(got: npt.NDArray[Any], want: list[Any], name: str) -> None:
    got_py = to_py(got, name)
    if name in COMPLEX:
        # numpy's complex multiply is not correctly rounded; allow a few ulps.
        rtol = 1e-5 if name == "complex64" else 1e-13
        np.testing.assert_allclose(np.array(got_py), np.array(want), rtol=rtol, atol=0)
    else:
        # Ints and bools exact; real floats exact too (both sides round once per step).
        assert got_py == want


# --------------------------------------------------------------------------------------------------
# ReduceOp


def test_reduce_op_members_and_alias() -> None:
    assert [m.name for m in ReduceOp] == ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
    assert reduce_op is ReduceOp
    assert reduce_op.SUM is ReduceOp.SUM
    assert ReduceOp("sum") is ReduceOp.SUM
    assert ReduceOp(ReduceOp.MAX) is ReduceOp.MAX
    assert as_reduce_op("bxor") is ReduceOp.BXOR


def test_as_reduce_op_errors() -> None:
    with pytest.raises(DistValueError, match="PREMUL_SUM"):
        as_reduce_op("premul_sum")
    with pytest.raises(DistValueError, match="unknown reduce op 'mean'"):
        as_reduce_op("mean")
    for bad in (0, None, 1.5, object()):
        with pytest.raises(DistTypeError, match="op must be a ReduceOp"):
            as_reduce_op(bad)
    with pytest.raises(DistTypeError, match="my_op"):
        as_reduce_op(3, arg="my_op")


def test_torch_reduce_ops_accepted_by_name() -> None:
    tdist = pytest.importorskip("torch.distributed")
    for member in ReduceOp:
        theirs = getattr(tdist.ReduceOp, member.name)
        assert as_reduce_op(theirs) is member
        assert ReduceOp(theirs) is member
        # torch.distributed.ReduceOp(...) instances wrap the enum value.
        assert as_reduce_op(tdist.ReduceOp(theirs)) is member
        assert check_reduce(theirs, np.int32) is member
    with pytest.raises(DistValueError, match="PREMUL_SUM"):
        as_reduce_op(tdist.ReduceOp.PREMUL_SUM)


def test_importing_ops_does_not_import_torch() -> None:
    code = "import sys, aiodist.ops, aiodist._tensors; sys.exit('torch' in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --------------------------------------------------------------------------------------------------
# dtypes


def test_dtype_names_round_trip() -> None:
    assert list(SUPPORTED_DTYPE_NAMES) == ALL
    for name in ALL:
        dt = dtype_from_name(name)
        assert dtype_name(dt) == name
        assert dtype_name(dt.type) == name  # scalar types are accepted too
    assert dtype_from_name("bfloat16") == np.dtype(ml_dtypes.bfloat16)
    assert dtype_name(np.dtype("q")) == "int64"


@pytest.mark.parametrize(
    "bad",
    [np.uint16, np.uint32, np.uint64, np.longdouble, object, "U4", "V8", ml_dtypes.float8_e4m3fn, ">i4"],
)
def test_unsupported_dtype(bad: Any) -> None:
    with pytest.raises(DistTypeError, match="unsupported dtype") as info:
        dtype_name(bad)
    if bad == ">i4":
        assert "byte order" in str(info.value)
    else:
        assert str(np.dtype(bad)) in str(info.value)


def test_bad_dtype_names() -> None:
    for bad in ("float", "torch.float32", "bf16", ""):
        with pytest.raises(DistTypeError, match=repr(bad)):
            dtype_from_name(bad)
    junk: Any
    for junk in ("no such dtype", None):
        with pytest.raises(DistTypeError, match="not a dtype"):
            dtype_name(junk)


# --------------------------------------------------------------------------------------------------
# op x dtype rules


def test_rule_table_is_complete() -> None:
    assert len(ALLOWED) + len(REFUSED) == 8 * 12
    assert len(REFUSED) == 3 * 6 + 2 * 2 + 1  # bitwise on float/complex, MIN/MAX complex, AVG bool


@pytest.mark.parametrize(("op", "name"), REFUSED, ids=lambda x: getattr(x, "name", x))
def test_refused_combinations(op: ReduceOp, name: str) -> None:
    dt = dtype_from_name(name)
    a = np.zeros(3, dtype=dt)
    for call in (
        lambda: check_reduce(op, dt),
        lambda: reduce_inplace(op, a, a.copy()),
        lambda: reduce_many(op, a, [a.copy()]),
        lambda: finalize_inplace(op, a, 2),
    ):
        with pytest.raises(DistTypeError) as info:
            call()
        assert isinstance(info.value, TypeError) and isinstance(info.value, DistError)
        assert f"ReduceOp.{op.name}" in str(info.value)
        assert name in str(info.value)


@pytest.mark.parametrize(("op", "name"), ALLOWED, ids=lambda x: getattr(x, "name", x))
def test_allowed_combinations_against_reference(op: ReduceOp, name: str) -> None:
    assert check_reduce(op, dtype_from_name(name)) is op
    for count in (1, 2, 5):
        inputs = make_inputs(name, count, 37, seed=zlib.crc32(f"{op.name}/{name}/{count}".encode()))
        want = reference(op, name, inputs)
        acc = inputs[0].copy()
        reduce_many(op, acc, inputs[1:])
        assert acc.dtype == inputs[0].dtype
        assert_matches(acc, want, name)
        # The same fold, one reduce_inplace at a time, with the op given by name.
        acc2 = inputs[0].copy()
        for other in inputs[1:]:
            reduce_inplace(op.name.lower(), acc2, other)
        np.testing.assert_array_equal(acc2, acc)


@pytest.mark.parametrize("name", [n for n in ALL if n != "bool"])
def test_avg_finalize_against_reference(name: str) -> None:
    for count in (1, 2, 3, 7):
        inputs = make_inputs(name, count, 41, seed=count)
        acc = inputs[0].copy()
        reduce_many(ReduceOp.AVG, acc, inputs[1:])
        finalize_inplace(ReduceOp.AVG, acc, count)
        total = reference(ReduceOp.SUM, name, inputs)
        if name in INTS:
            # Truncation toward zero of the (wrapped) sum, like NCCL.
            want: list[Any] = [_tdiv(s, count) for s in total]
            assert to_py(acc, name) == want
        elif name in FLOATS:
            dt = dtype_from_name(name)
            want = [float(np.float64(s / count).astype(dt)) for s in total]
            assert to_py(acc, name) == want
        else:
            want = [s / count for s in total]
            np.testing.assert_allclose(acc, np.array(want), rtol=1e-6)


def _tdiv(a: int, n: int) -> int:
    q = abs(a) // n
    return -q if a < 0 else q


def test_avg_int_truncates_toward_zero() -> None:
    a = np.array([-7, 7, -6, 6, -1, 1, 0], dtype=np.int32)
    finalize_inplace(ReduceOp.AVG, a, 3)
    assert a.tolist() == [-2, 2, -2, 2, 0, 0, 0]


def test_avg_int_extremes() -> None:
    # A divisor outside the dtype's range (world size 200 with int8 data) and the most negative values.
    a = np.array([-128, 127, -100, 0], dtype=np.int8)
    finalize_inplace(ReduceOp.AVG, a, 200)
    assert a.tolist() == [0, 0, 0, 0]
    a = np.array([-128, 127, -127], dtype=np.int8)
    finalize_inplace(ReduceOp.AVG, a, 128)
    assert a.tolist() == [-1, 0, 0]
    u = np.array([255, 254, 1], dtype=np.uint8)
    finalize_inplace(ReduceOp.AVG, u, 300)
    assert u.tolist() == [0, 0, 0]
    finalize_inplace(ReduceOp.AVG, u, 1)
    big = np.array([np.iinfo(np.int64).min, np.iinfo(np.int64).max, -(2**62) - 1], dtype=np.int64)
    finalize_inplace(ReduceOp.AVG, big, 3)
    assert big.tolist() == [_tdiv(-(2**63), 3), _tdiv(2**63 - 1, 3), _tdiv(-(2**62) - 1, 3)]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=20),
    st.integers(1, 2**40),
    st.sampled_from(INTS),
)
def test_avg_int_property(values: list[int], count: int, name: str) -> None:
    a = np.array([wrap(v, name) for v in values], dtype=name)
    want = [_tdiv(int(v), count) for v in a]
    finalize_inplace(ReduceOp.AVG, a, count)
    assert a.tolist() == want


def test_avg_large_int_and_noncontiguous() -> None:
    rng = np.random.default_rng(1)
    n = (1 << 16) * 2 + 17  # several division chunks and a ragged tail
    a = rng.integers(-(2**62), 2**62, size=n, dtype=np.int64)
    want = np.sign(a) * (np.abs(a) // 7)
    finalize_inplace(ReduceOp.AVG, a, 7)
    np.testing.assert_array_equal(a, want)
    b16 = rng.integers(-30000, 30000, size=n, dtype=np.int16)
    want16 = (np.sign(b16) * (np.abs(b16.astype(np.int64)) // 9)).astype(np.int16)
    finalize_inplace(ReduceOp.AVG, b16, 9)
    np.testing.assert_array_equal(b16, want16)
    m = np.arange(-12, 12, dtype=np.int32).reshape(4, 6).T  # not C-contiguous
    want_m = np.sign(m) * (np.abs(m) // 5)
    finalize_inplace(ReduceOp.AVG, m, 5)
    np.testing.assert_array_equal(m, want_m)


def test_avg_float_precision_and_huge_count() -> None:
    a = np.array([3.0, -1.0, 1.0], dtype=np.float16)
    finalize_inplace(ReduceOp.AVG, a, 100_000)  # larger than float16's max: divided in float32
    assert a.tolist() == [float(np.float16(3.0 / 100_000)), float(np.float16(-1e-5)), float(np.float16(1e-5))]
    c = np.array([3 + 6j], dtype=np.complex64)
    finalize_inplace(ReduceOp.AVG, c, 3)
    assert c.dtype == np.complex64 and c.tolist() == [1 + 2j]


def test_finalize_is_noop_except_avg() -> None:
    for op in ReduceOp:
        if op is ReduceOp.AVG:
            continue
        a = np.array([7, -7], dtype=np.int32)
        finalize_inplace(op, a, 4)
        assert a.tolist() == [7, -7]


def test_finalize_errors() -> None:
    a = np.ones(3, dtype=np.float32)
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(DistValueError, match="count"):
            finalize_inplace(ReduceOp.AVG, a, bad)  # type: ignore[arg-type]
    a.flags.writeable = False
    with pytest.raises(DistValueError, match="read-only"):
        finalize_inplace(ReduceOp.AVG, a, 2)
    finalize_inplace(ReduceOp.AVG, np.empty(0, dtype=np.int8), 3)
    finalize_inplace(ReduceOp.AVG, np.empty(0, dtype=ml_dtypes.bfloat16), 3)


# --------------------------------------------------------------------------------------------------
# kernels: bool semantics, half precision, special values, misuse


def test_bool_semantics() -> None:
    a0 = np.array([False, False, True, True])
    b = np.array([False, True, False, True])
    table = {
        ReduceOp.SUM: [False, True, True, True],
        ReduceOp.MAX: [False, True, True, True],
        ReduceOp.BOR: [False, True, True, True],
        ReduceOp.PRODUCT: [False, False, False, True],
        ReduceOp.MIN: [False, False, False, True],
        ReduceOp.BAND: [False, False, False, True],
        ReduceOp.BXOR: [False, True, True, False],
    }
    for op, want in table.items():
        a = a0.copy()
        reduce_inplace(op, a, b)
        assert a.dtype == np.bool_ and a.tolist() == want, op
    # SUM saturates: many trues stay True (no counting, no wrap).
    a = np.array([True])
    reduce_many(ReduceOp.SUM, a, [np.array([True])] * 300)
    assert a.tolist() == [True]


def test_int_wraps_like_twos_complement() -> None:
    a = np.array([127, -128, 100], dtype=np.int8)
    reduce_inplace(ReduceOp.SUM, a, np.array([1, -1, 100], dtype=np.int8))
    assert a.tolist() == [-128, 127, -56]
    u = np.array([200], dtype=np.uint8)
    reduce_inplace(ReduceOp.PRODUCT, u, np.array([3], dtype=np.uint8))
    assert u.tolist() == [600 % 256]


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float64"])
def test_min_max_propagate_nan_and_overflow_is_quiet(name: str, recwarn: pytest.WarningsRecorder) -> None:
    dt = dtype_from_name(name)
    a = np.array([np.nan, 1.0, 2.0], dtype=dt)
    b = np.array([1.0, np.nan, 3.0], dtype=dt)
    for op, last in ((ReduceOp.MIN, 2.0), (ReduceOp.MAX, 3.0)):
        acc = a.copy()
        reduce_inplace(op, acc, b)
        got = acc.astype(np.float64)
        assert math.isnan(got[0]) and math.isnan(got[1]) and got[2] == last
    big = np.array([ml_dtypes.finfo(dt).max], dtype=dt)  # type: ignore[no-untyped-call]
    reduce_inplace(ReduceOp.SUM, big, big.copy())
    assert np.isinf(big.astype(np.float64)[0])
    assert not [w for w in recwarn.list if issubclass(w.category, RuntimeWarning)]


def test_bfloat16_large_array_matches_float64_reference() -> None:
    # Larger than numpy's casting buffer, so the float32 detour runs in several chunks.
    rng = np.random.default_rng(7)
    n = 100_003
    a = rng.standard_normal(n).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal(n).astype(ml_dtypes.bfloat16)
    for op, f in ((ReduceOp.SUM, np.add), (ReduceOp.PRODUCT, np.multiply), (ReduceOp.MAX, np.maximum)):
        acc = a.copy()
        reduce_inplace(op, acc, b)
        want = f(a.astype(np.float64), b.astype(np.float64)).astype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(acc.view(np.uint16), want.view(np.uint16))
        # And the same as ml_dtypes' own element-wise loops.
        native = f(a, b)
        np.testing.assert_array_equal(acc.view(np.uint16), native.view(np.uint16))


def test_reduce_inplace_misuse() -> None:
    a = np.zeros(4, dtype=np.float32)
    with pytest.raises(DistTypeError, match="float64 into float32"):
        reduce_inplace(ReduceOp.SUM, a, np.zeros(4, dtype=np.float64))
    with pytest.raises(DistValueError, match=r"shape \(3,\) into shape \(4,\)"):
        reduce_inplace(ReduceOp.SUM, a, np.zeros(3, dtype=np.float32))
    with pytest.raises(DistTypeError, match="unsupported dtype uint16"):
        reduce_inplace(ReduceOp.SUM, np.zeros(2, np.uint16), np.zeros(2, np.uint16))
    ro = np.zeros(4, dtype=np.float32)
    ro.flags.writeable = False
    with pytest.raises(DistValueError, match="read-only"):
        reduce_inplace(ReduceOp.SUM, ro, a)
    reduce_inplace(ReduceOp.SUM, a, ro)  # a read-only operand is fine


def test_reduce_many_folds_in_order_and_accepts_iterables() -> None:
    out = np.array([1, 2], dtype=np.int64)
    reduce_many(ReduceOp.SUM, out, [])
    assert out.tolist() == [1, 2]
    reduce_many(ReduceOp.SUM, out, (np.array([10, 20]) for _ in range(3)))
    assert out.tolist() == [31, 62]
    reduce_many(ReduceOp.MAX, out, [out])  # exact aliasing is harmless for idempotent ops
    assert out.tolist() == [31, 62]


def test_empty_and_multidimensional() -> None:
    for name in ALL:
        dt = dtype_from_name(name)
        e = np.empty(0, dtype=dt)
        reduce_inplace(ReduceOp.SUM, e, e.copy())
    m = np.arange(6, dtype=np.float32).reshape(2, 3)
    reduce_inplace(ReduceOp.PRODUCT, m, m.copy())
    assert m.tolist() == [[0, 1, 4], [9, 16, 25]]


def test_reduce_in_worker_threads() -> None:
    # The kernels are plain ufunc calls: safe to run concurrently on disjoint data.
    arrays = [np.full(50_000, i, dtype=ml_dtypes.bfloat16) for i in range(4)]
    threads = [threading.Thread(target=reduce_inplace, args=(ReduceOp.SUM, a, a.copy())) for a in arrays]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, a in enumerate(arrays):
        assert float(a[0]) == float(a[-1]) == 2 * i
