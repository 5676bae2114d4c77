"""aiodist._tensors: zero-copy views of numpy arrays and torch CPU tensors, and the errors around them."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt
import pytest

from aiodist import _tensors
from aiodist._tensors import (
    as_array,
    as_arrays,
    describe,
    is_tensor_like,
    is_torch_tensor,
    numpy_dtype_for,
    torch_dtype_for,
)
from aiodist.errors import DistTypeError, DistValueError
from aiodist.ops import SUPPORTED_DTYPE_NAMES, dtype_from_name

ALL = list(SUPPORTED_DTYPE_NAMES)


def sample(name: str, n: int) -> npt.NDArray[Any]:
    dt = dtype_from_name(name)
    if name == "bool":
        return np.asarray(np.arange(n) % 3 == 0)
    if name.startswith("complex"):
        return (np.arange(n) + 1j * np.arange(n)).astype(dt)
    return np.arange(n).astype(dt)


def marker(name: str) -> Any:
    """A value distinct from everything sample() produces."""
    return {"bool": True, "uint8": 200}.get(name, -5 - 2j if name.startswith("complex") else -5)


# --------------------------------------------------------------------------------------------------
# numpy


@pytest.mark.parametrize("name", ALL)
def test_numpy_view_shares_memory(name: str) -> None:
    arr = sample(name, 12).reshape(3, 4)
    view = as_array(arr, arg="tensor", writable=True)
    assert view.ndim == 1 and view.size == 12 and view.flags.c_contiguous
    assert view.dtype == arr.dtype == dtype_from_name(name)
    assert np.shares_memory(view, arr)
    view[5] = marker(name)
    assert arr[1, 1] == view[5]
    ro = as_array(arr, arg="tensor", writable=False)
    assert not ro.flags.writeable and arr.flags.writeable and np.shares_memory(ro, arr)


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")
def test_numpy_zero_d_empty_and_subclass() -> None:
    scalar = np.array(3.5, dtype=np.float32)
    v = as_array(scalar, arg="t", writable=True)
    assert v.shape == (1,)
    v[0] = 7
    assert scalar == 7
    empty = np.empty((0, 4), dtype=ml_dtypes.bfloat16)
    assert as_array(empty, arg="t", writable=True).shape == (0,)
    m = np.matrix([[1, 2], [3, 4]], dtype=np.int32)
    mv = as_array(m, arg="t", writable=True)
    assert type(mv) is np.ndarray and mv.shape == (4,)
    mv[3] = 40
    assert m[1, 1] == 40


def test_numpy_non_contiguous() -> None:
    a = np.arange(20, dtype=np.float32)
    for bad in (a[::2], a.reshape(4, 5).T, np.asfortranarray(a.reshape(4, 5))):
        with pytest.raises(DistValueError, match=r"output_tensor must be C-contiguous.*strides"):
            as_array(bad, arg="output_tensor", writable=False)
    # Size <= 1 and unit-length axes count as contiguous whatever the strides: a view is fine.
    as_array(a[::5][:1], arg="t", writable=True)


def test_numpy_read_only() -> None:
    a = np.arange(4, dtype=np.int64)
    a.flags.writeable = False
    with pytest.raises(DistValueError, match="tensor_list is read-only"):
        as_array(a, arg="tensor_list", writable=True)
    assert as_array(a, arg="x", writable=False).tolist() == [0, 1, 2, 3]
    frozen = np.frombuffer(b"\x00" * 16, dtype=np.int32)
    with pytest.raises(DistValueError, match="read-only"):
        as_array(frozen, arg="t", writable=True)


@pytest.mark.parametrize("dtype", [np.uint16, np.uint64, object, "U3", ">i4", ml_dtypes.float8_e5m2])
def test_numpy_unsupported_dtype(dtype: Any) -> None:
    a = np.zeros(3, dtype=dtype)
    with pytest.raises(DistTypeError, match=r"^input: unsupported dtype"):
        as_array(a, arg="input", writable=False)
    with pytest.raises(DistTypeError, match=r"^input: unsupported dtype"):
        describe(a, arg="input")


@pytest.mark.parametrize("bad", [[1, 2, 3], 3.0, None, b"abc", np.float32(1.0), memoryview(b"ab")])
def test_not_an_array(bad: object) -> None:
    with pytest.raises(DistTypeError, match=r"^tensor must be a numpy.ndarray or a torch.Tensor, got "):
        as_array(bad, arg="tensor", writable=False)
    with pytest.raises(DistTypeError, match=r"^tensor must be"):
        describe(bad)
    assert not is_tensor_like(bad)
    assert not is_torch_tensor(bad)


def test_masked_array_refused() -> None:
    with pytest.raises(DistTypeError, match="masked"):
        as_array(np.ma.masked_array([1, 2], mask=[False, True]), arg="t", writable=False)


def test_as_arrays_names_the_element() -> None:
    good = [np.zeros(2, np.float32), np.ones(3, np.int8)]
    views = as_arrays(good, arg="tensor_list", writable=True)
    assert [v.size for v in views] == [2, 3] and all(
        np.shares_memory(v, g) for v, g in zip(views, good, strict=True)
    )
    assert as_arrays((), arg="x", writable=False) == []
    with pytest.raises(DistValueError, match=r"^tensor_list\[1\] must be C-contiguous"):
        as_arrays([good[0], np.zeros(6)[::2]], arg="tensor_list", writable=True)
    with pytest.raises(DistTypeError, match=r"^scatter_list\[2\] must be a numpy.ndarray"):
        as_arrays([good[0], good[0], "x"], arg="scatter_list", writable=False)
    with pytest.raises(DistTypeError, match=r"^tensor_list must be a list of tensors, got ndarray"):
        as_arrays(np.zeros((2, 2)), arg="tensor_list", writable=False)  # type: ignore[arg-type]


def test_describe_numpy() -> None:
    assert describe(np.zeros((2, 3), dtype=ml_dtypes.bfloat16)) == ("bfloat16", 6, (2, 3))
    assert describe(np.zeros((4, 5), np.int16).T) == ("int16", 20, (5, 4))  # non-contiguous is fine
    assert describe(np.array(True)) == ("bool", 1, ())
    assert is_tensor_like(np.zeros(1))


# --------------------------------------------------------------------------------------------------
# torch

torch: Any
try:
    import torch
except ImportError:  # torch is optional; the numpy half above still runs
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


def torch_sample(name: str, shape: tuple[int, ...]) -> Any:
    n = int(np.prod(shape))
    if name == "bfloat16":
        return torch.arange(n, dtype=torch.bfloat16).reshape(shape)
    return torch.from_numpy(sample(name, n)).reshape(shape).clone()


@needs_torch
@pytest.mark.parametrize("name", ALL)
def test_torch_view_shares_memory(name: str) -> None:
    t = torch_sample(name, (3, 4))
    assert str(t.dtype) == f"torch.{name}"
    view = as_array(t, arg="tensor", writable=True)
    assert view.ndim == 1 and view.size == 12 and view.flags.c_contiguous and view.flags.writeable
    assert view.dtype == dtype_from_name(name)
    assert view.ctypes.data == t.data_ptr()
    view[5] = marker(name)
    got = t[1, 1].item()
    assert got == marker(name)
    # ...and the other direction: a torch write shows through the view.
    t[0, 0] = t[1, 1]
    assert view[0] == view[5]
    assert describe(t) == (name, 12, (3, 4))
    assert is_torch_tensor(t) and is_tensor_like(t)


@needs_torch
def test_torch_bfloat16_values() -> None:
    t = torch.tensor([1.5, -2.25, 3e38], dtype=torch.bfloat16)
    v = as_array(t, arg="t", writable=True)
    assert v.dtype == ml_dtypes.bfloat16
    assert v.astype(np.float32).tolist() == t.float().tolist()
    v[1] = 0.5
    assert t[1].item() == 0.5


@needs_torch
@pytest.mark.parametrize("name", ALL)
def test_torch_zero_d_and_empty(name: str) -> None:
    t0 = torch_sample(name, (1,)).reshape(())
    v = as_array(t0, arg="t", writable=True)
    assert v.shape == (1,)
    v[0] = marker(name)
    assert t0.item() == marker(name)
    assert describe(t0) == (name, 1, ())
    empty = torch_sample(name, (0, 3))
    assert as_array(empty, arg="t", writable=True).shape == (0,)
    assert describe(empty) == (name, 0, (0, 3))


@needs_torch
def test_torch_requires_grad_and_parameter() -> None:
    p = torch.nn.Parameter(torch.zeros(4))
    v = as_array(p, arg="param", writable=True)
    v[:] = 3.0
    assert p.requires_grad and p.detach().tolist() == [3.0] * 4
    g = torch.ones(2, 2, requires_grad=True)
    ro = as_array(g, arg="t", writable=False)
    assert not ro.flags.writeable and ro.ctypes.data == g.data_ptr()  # an input: read-only view
    assert as_array(g, arg="t", writable=True).flags.writeable


@needs_torch
def test_torch_offset_view_and_single_column_transpose() -> None:
    base = torch.arange(10, dtype=torch.int32)
    part = base[3:7]  # contiguous, with a storage offset
    v = as_array(part, arg="t", writable=True)
    v[0] = -1
    assert base[3].item() == -1
    col = torch.zeros(1, 3).t()  # shape (3, 1): torch calls it contiguous
    as_array(col, arg="t", writable=True)[2] = 9
    assert col[2, 0].item() == 9


@needs_torch
def test_torch_non_contiguous() -> None:
    t = torch.zeros(4, 6)
    for bad in (
        t.t(),
        t[:, ::2],
        t.expand(2, 4, 6),
        torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last),
    ):
        with pytest.raises(
            DistValueError, match=r"^output must be contiguous \(call \.contiguous\(\) first\)"
        ):
            as_array(bad, arg="output", writable=True)
        assert describe(bad)[0] == "float32"


@needs_torch
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("dtype_attr", ["uint16", "uint32", "uint64", "complex32", "float8_e4m3fn", "qint8"])
def test_torch_unsupported_dtype(dtype_attr: str) -> None:
    dtype = getattr(torch, dtype_attr, None)
    if dtype is None:
        pytest.skip(f"torch has no {dtype_attr}")
    t = torch.empty(2, dtype=torch.float32)
    try:
        t = (
            torch.quantize_per_tensor(t, 0.1, 0, dtype)
            if dtype_attr == "qint8"
            else torch.zeros(2, dtype=dtype)
        )
    except (RuntimeError, TypeError):
        pytest.skip(f"cannot build a {dtype_attr} tensor")
    with pytest.raises(DistTypeError, match=f"^input_tensor: unsupported dtype torch.{dtype_attr}"):
        as_array(t, arg="input_tensor", writable=False)
    with pytest.raises(DistTypeError, match=f"unsupported dtype torch.{dtype_attr}"):
        describe(t, arg="input_tensor")


@needs_torch
def test_torch_sparse_conj_and_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    sparse = torch.zeros(3, 3).to_sparse()
    with pytest.raises(DistTypeError, match=r"^t: only dense"):
        as_array(sparse, arg="t", writable=False)
    conj = torch.ones(3, dtype=torch.complex64).conj()
    with pytest.raises(DistValueError, match="resolve_conj"):
        as_array(conj, arg="t", writable=False)
    as_array(conj.resolve_conj(), arg="t", writable=False)
    meta = torch.empty(3, device="meta")
    with pytest.raises(DistValueError, match=r"^t is on device meta; only CPU tensors"):
        as_array(meta, arg="t", writable=False)
    # No GPU here: pretend, through the one hook that later staging code replaces.
    monkeypatch.setattr(_tensors, "_is_cuda", lambda obj: True)
    with pytest.raises(DistValueError, match=r"^tensor is a CUDA tensor .*staging") as info:
        as_array(torch.zeros(2), arg="tensor", writable=True)
    assert "backend" in str(info.value)


@needs_torch
def test_torch_cuda_hook_is_false_on_cpu() -> None:
    assert _tensors._is_cuda(torch.zeros(1)) is False
    assert _tensors._is_cuda(np.zeros(1)) is False


@needs_torch
def test_torch_lists() -> None:
    ts = [torch.zeros(2), torch.zeros(3, dtype=torch.bfloat16), torch.zeros(4).t()]
    views = as_arrays(ts, arg="output_tensor_list", writable=True)
    views[1][2] = 1.0
    assert ts[1][2].item() == 1.0
    with pytest.raises(DistValueError, match=r"^tensor_list\[1\]"):
        as_arrays([ts[0], torch.zeros(3, 3).t()], arg="tensor_list", writable=True)


@needs_torch
@pytest.mark.parametrize("name", ALL)
def test_dtype_conversions(name: str) -> None:
    tdt = torch_dtype_for(dtype_from_name(name))
    assert tdt is getattr(torch, name)
    assert numpy_dtype_for(tdt) == dtype_from_name(name)
    assert torch.zeros(1, dtype=tdt).dtype is tdt


@needs_torch
def test_dtype_conversion_errors() -> None:
    with pytest.raises(DistTypeError, match="unsupported dtype uint16"):
        torch_dtype_for(np.uint16)
    with pytest.raises(DistTypeError, match="'uint16'"):
        numpy_dtype_for(torch.uint16)
    for bad in (np.float32, "torch.float32", None):
        with pytest.raises(DistTypeError, match="not a torch dtype"):
            numpy_dtype_for(bad)
    assert numpy_dtype_for(torch.half) == np.float16 and numpy_dtype_for(torch.cfloat) == np.complex64
