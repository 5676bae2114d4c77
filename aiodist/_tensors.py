"""numpy / torch adaptation: the one module that knows about torch.

Everything above this module sees flat, C-contiguous numpy arrays that share memory with the
user's numpy array or torch CPU tensor, so a collective writes its result straight into the
caller's buffer. torch is never imported here at module import: a tensor can only exist once
torch is in ``sys.modules``, so detection looks there, and conversions import it on demand.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Sequence
from typing import Any, cast

import ml_dtypes
import numpy as np
import numpy.typing as npt

from .errors import DistTypeError, DistValueError
from .ops import SUPPORTED_DTYPE_NAMES, dtype_from_name, dtype_name

__all__ = [
    "DeviceTensorError",
    "byte_view",
    "NotContiguousError",
    "as_array",
    "as_arrays",
    "check_tensor",
    "describe",
    "device_of",
    "is_tensor_like",
    "is_torch_tensor",
    "numpy_dtype_for",
    "to_torch",
    "torch_dtype_for",
]

_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_PLAIN_DTYPES = frozenset(dtype_from_name(name) for name in SUPPORTED_DTYPE_NAMES)


def is_torch_tensor(obj: object) -> bool:
    """True if ``obj`` is a ``torch.Tensor`` (or subclass, e.g. ``nn.Parameter``); never imports torch."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    tensor_type = getattr(torch, "Tensor", None)
    # While torch is half-imported, Tensor may not exist yet; nothing can be a tensor then.
    return isinstance(tensor_type, type) and isinstance(obj, tensor_type)


def is_tensor_like(obj: object) -> bool:
    """True if ``obj`` is a ``numpy.ndarray`` or a ``torch.Tensor``."""
    return isinstance(obj, np.ndarray) or is_torch_tensor(obj)


def _is_cuda(obj: Any) -> bool:
    """True for a torch CUDA tensor. The single hook for staging device memory through the host."""
    return bool(is_torch_tensor(obj) and obj.device.type == "cuda")


_IS_CUDA = _is_cuda


class DeviceTensorError(DistValueError):
    """A CUDA tensor reached code that only views host memory.

    A group whose backend stages device tensors (``aiodist.backends.staged``) never shows
    one to this layer (its twin in host memory is); anywhere else it is the user's error.
    """


class NotContiguousError(DistValueError):
    """A tensor or array that is not (C-)contiguous reached code that views its memory flat.

    The blocking face (``aiodist.sync``) catches it and runs the operation on contiguous copies,
    writing the results back, as gloo does; the async face leaves the copy to the caller.
    """


def device_of(obj: object) -> str:
    """``"cpu"`` for a numpy array, the device of a torch tensor (``"cuda:0"``) otherwise."""
    if is_torch_tensor(obj):
        return str(cast(Any, obj).device)
    return "cpu"


def _torch_dtype_name(tensor: Any, arg: str) -> str:
    # str(torch.float32) == "torch.float32"; aliases (torch.half, torch.cfloat) print canonically.
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in SUPPORTED_DTYPE_NAMES:
        raise DistTypeError(
            f"{arg}: unsupported dtype torch.{name}; supported: {', '.join(SUPPORTED_DTYPE_NAMES)}"
        )
    return name


def _numpy_dtype_name(arr: npt.NDArray[Any], arg: str) -> str:
    try:
        return dtype_name(arr.dtype)
    except DistTypeError as exc:
        raise DistTypeError(f"{arg}: {exc}") from None


def _type_error(obj: object, arg: str) -> DistTypeError:
    return DistTypeError(f"{arg} must be a numpy.ndarray or a torch.Tensor, got {type(obj).__qualname__}")


def as_array(obj: object, *, arg: str, writable: bool) -> npt.NDArray[Any]:
    """A flat, C-contiguous numpy view sharing memory with ``obj``.

    Writes through the view land in the user's array or tensor. A 0-d input gives a view of size 1.

    Args:
        obj: a C-contiguous ``numpy.ndarray`` or a contiguous torch CPU tensor of a supported dtype
            (one requiring grad is fine: the view bypasses autograd, as torch.distributed does).
        arg: the argument name, used in error messages.
        writable: the caller will write into the view (an output). When False the returned view
            is marked read-only, so that a bug cannot scribble on an input.

    Returns:
        A 1-D numpy array; bfloat16 data has dtype ``ml_dtypes.bfloat16``.

    Raises:
        DistTypeError: not an array/tensor, unsupported dtype, sparse or otherwise non-strided
            tensor, or a tensor numpy cannot view.
        DistValueError: not contiguous, read-only while ``writable``, a tensor with a lazy
            conjugate/negative bit, or on a device other than the CPU (a CUDA tensor raises
            ``DeviceTensorError``, which the operations turn into staging).
    """
    if type(obj) is np.ndarray and obj.dtype in _PLAIN_DTYPES:
        # Fast path (every message passes here): a plain array of a supported dtype needs
        # only the contiguity and writability checks of _numpy_view.
        flags = obj.flags
        if flags.c_contiguous and (flags.writeable or not writable):
            flat = obj.reshape(-1)
            if not writable:
                flat.flags.writeable = False
            return flat
    if isinstance(obj, np.ndarray):
        arr = _numpy_view(obj, arg, writable)
    elif is_torch_tensor(obj):
        arr = _torch_view(obj, arg)
    else:
        raise _type_error(obj, arg)
    # arr is C-contiguous (checked above), so this reshape is a view, never a copy.
    flat = arr.reshape(-1)
    if not writable:
        flat.flags.writeable = False
    return flat


#: (torch.Tensor, the torch dtypes numpy views directly, torch.strided), once torch is imported.
_torch_plain: tuple[Any, frozenset[Any], Any] | None = None


def _load_torch_plain() -> tuple[Any, frozenset[Any], Any] | None:
    global _torch_plain
    torch = sys.modules.get("torch")
    tensor_type = getattr(torch, "Tensor", None)
    strided = getattr(torch, "strided", None)
    if not isinstance(tensor_type, type) or strided is None:  # no torch, or half-imported
        return None
    dtypes = frozenset(
        getattr(torch, name) for name in SUPPORTED_DTYPE_NAMES if name != "bfloat16" and hasattr(torch, name)
    )
    _torch_plain = (tensor_type, dtypes, strided)
    return _torch_plain


def _numpy_view(arr: npt.NDArray[Any], arg: str, writable: bool) -> npt.NDArray[Any]:
    if isinstance(arr, np.ma.MaskedArray):
        # Its mask would be silently dropped.
        raise DistTypeError(f"{arg}: masked arrays are not supported; pass arr.filled() or arr.data")
    _numpy_dtype_name(arr, arg)
    if not arr.flags.c_contiguous:
        raise NotContiguousError(
            f"{arg} must be C-contiguous (use numpy.ascontiguousarray); "
            f"got shape {arr.shape} with strides {arr.strides}"
        )
    if writable and not arr.flags.writeable:
        raise DistValueError(f"{arg} is read-only but is written to by this operation")
    # Subclasses such as np.matrix do not reshape to 1-D; the base class does.
    return arr if type(arr) is np.ndarray else arr.view(np.ndarray)


def check_tensor(tensor: Any, *, arg: str) -> str:
    """Check a torch tensor on any device as ``as_array`` would, without viewing its memory.

    For the code that hands tensors to something other than numpy (a staging copy, a torch
    engine). Returns the canonical dtype name.

    Raises:
        DistTypeError: not a tensor, unsupported dtype, or not dense.
        DistValueError: not contiguous, or a lazy conjugate/negative bit.
    """
    if not is_torch_tensor(tensor):
        raise _type_error(tensor, arg)
    name = _torch_dtype_name(tensor, arg)
    _check_strided(tensor, arg)
    _check_contiguous(tensor, arg)
    return name


def _check_contiguous(tensor: Any, arg: str) -> None:
    if not tensor.is_contiguous():
        raise NotContiguousError(
            f"{arg} must be contiguous (call .contiguous() first); "
            f"got shape {tuple(tensor.shape)} with strides {tensor.stride()}"
        )
    if tensor.is_conj() or tensor.is_neg():
        # The memory holds the un-conjugated / un-negated values; a view would expose those.
        raise DistValueError(
            f"{arg} has a lazy conjugate or negative bit; call .resolve_conj() / .resolve_neg()"
        )


def _check_strided(tensor: Any, arg: str) -> None:
    if tensor.layout != sys.modules["torch"].strided:
        raise DistTypeError(f"{arg}: only dense (strided) tensors are supported, got layout {tensor.layout}")


def _torch_view(tensor: Any, arg: str) -> npt.NDArray[Any]:
    # A plain CPU tensor (every sync-face call has one) passes the checks below in their
    # cheapest form: 1.9 µs for the whole as_array instead of 2.9 (timeit). ``is_cpu`` stands
    # in for ``_is_cuda``, so this is skipped while that hook is replaced (tests pretend CUDA
    # through it).
    plain = _torch_plain or _load_torch_plain()
    if (
        plain is not None
        and type(tensor) is plain[0]
        and _is_cuda is _IS_CUDA
        and tensor.dtype in plain[1]
        and tensor.layout is plain[2]
        and tensor.is_cpu
        and tensor.is_contiguous()
        and not tensor.is_conj()
        and not tensor.is_neg()
    ):
        return cast("npt.NDArray[Any]", tensor.detach().numpy())
    torch = sys.modules["torch"]
    name = _torch_dtype_name(tensor, arg)
    _check_strided(tensor, arg)
    if _is_cuda(tensor):
        raise DeviceTensorError(
            f"{arg} is a CUDA tensor ({tensor.device}); staging CUDA tensors through pinned host memory "
            "is done only by the operations of a group from init_process_group (backend 'tcp'; "
            "backend 'nccl' runs them natively): move it to the CPU first"
        )
    if tensor.device.type != "cpu":
        raise DistValueError(f"{arg} is on device {tensor.device}; only CPU tensors are supported")
    _check_contiguous(tensor, arg)
    t = tensor.detach()
    try:
        # torch cannot hand bfloat16 to numpy: view the same bytes as int16, then as ml_dtypes'.
        arr = t.view(torch.int16).numpy().view(_BFLOAT16) if name == "bfloat16" else t.numpy()
    except (RuntimeError, TypeError) as exc:
        # Tensor subclasses without real storage (fake, functional, distributed) land here.
        raise DistTypeError(
            f"{arg}: cannot view {type(tensor).__qualname__} as a numpy array: {exc}"
        ) from exc
    return cast("npt.NDArray[Any]", arr)


def to_torch(arr: npt.NDArray[Any]) -> Any:
    """A torch CPU tensor sharing memory with the numpy array ``arr`` (bfloat16 included; imports torch).

    Args:
        arr: a C-contiguous numpy array of a supported dtype (``ml_dtypes.bfloat16`` too).

    Returns:
        A ``torch.Tensor`` of the same shape and dtype over the same bytes.
    """
    torch = importlib.import_module("torch")
    if not arr.flags.writeable:
        # torch warns about read-only arrays; an input view of a writable array can be re-flagged
        # (aiodist never writes through an input), a truly read-only one is converted quietly.
        try:
            view = arr.view()
            view.flags.writeable = True
            arr = view
        except ValueError:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return _from_numpy(torch, arr)
    return _from_numpy(torch, arr)


def _from_numpy(torch: Any, arr: npt.NDArray[Any]) -> Any:
    if arr.dtype == _BFLOAT16:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def as_arrays(objs: Sequence[object], *, arg: str, writable: bool) -> list[npt.NDArray[Any]]:
    """:func:`as_array` for each element of a tensor list.

    Args:
        objs: a list or tuple of arrays/tensors.
        arg: the list's argument name; errors name the element as ``arg[i]``.
        writable: as for :func:`as_array`.

    Returns:
        One flat view per element, in order.

    Raises:
        DistTypeError: ``objs`` is not a list or tuple, or an element is rejected (see as_array).
        DistValueError: an element is rejected (see as_array).
    """
    if not isinstance(objs, list | tuple):
        raise DistTypeError(f"{arg} must be a list of tensors, got {type(objs).__qualname__}")
    return [as_array(obj, arg=f"{arg}[{i}]", writable=writable) for i, obj in enumerate(objs)]


def describe(obj: object, *, arg: str = "tensor") -> tuple[str, int, tuple[int, ...]]:
    """``(dtype name, number of elements, shape)`` of an array or tensor, without viewing its data.

    Works for non-contiguous and CUDA tensors too, for messages and fingerprints.

    Args:
        obj: a numpy array or torch tensor.
        arg: the argument name, used in error messages.

    Returns:
        The canonical dtype name (see :func:`aiodist.ops.dtype_name`), numel and shape.

    Raises:
        DistTypeError: not an array/tensor, or an unsupported dtype.
    """
    if isinstance(obj, np.ndarray):
        return _numpy_dtype_name(obj, arg), int(obj.size), tuple(int(d) for d in obj.shape)
    if is_torch_tensor(obj):
        t = cast(Any, obj)
        return _torch_dtype_name(t, arg), int(t.numel()), tuple(int(d) for d in t.shape)
    raise _type_error(obj, arg)


def torch_dtype_for(dtype: npt.DTypeLike) -> Any:
    """The torch dtype matching a supported numpy dtype (imports torch).

    Args:
        dtype: a numpy dtype (``ml_dtypes.bfloat16`` maps to ``torch.bfloat16``).

    Returns:
        The ``torch.dtype``.

    Raises:
        DistTypeError: unsupported dtype.
        ImportError: torch is not installed.
    """
    # Our canonical names are exactly torch's attribute names.
    return getattr(importlib.import_module("torch"), dtype_name(dtype))


def numpy_dtype_for(torch_dtype: object) -> np.dtype[Any]:
    """The numpy dtype matching a supported torch dtype (``torch.bfloat16`` -> ``ml_dtypes.bfloat16``).

    Args:
        torch_dtype: a ``torch.dtype``.

    Returns:
        The numpy dtype.

    Raises:
        DistTypeError: not a torch dtype, or an unsupported one.
    """
    text = str(torch_dtype)
    if not type(torch_dtype).__module__.startswith("torch") or not text.startswith("torch."):
        raise DistTypeError(f"not a torch dtype: {torch_dtype!r}")
    return dtype_from_name(text.removeprefix("torch."))


def byte_view(arr: np.ndarray) -> memoryview:
    """A flat writable-if-possible byte view of a C-contiguous array (any dtype, bfloat16 too)."""
    try:
        # The common case in one step (a third of the time of the numpy view below, which is
        # on the path of every message); dtypes the buffer protocol cannot describe
        # (bfloat16) raise, and take the general route.
        return memoryview(arr).cast("B")  # type: ignore[arg-type]
    except (TypeError, ValueError, NotImplementedError):
        flat: Any = arr.reshape(-1).view(np.uint8)  # numpy arrays are buffers; its stubs don't say so
        return memoryview(flat)
