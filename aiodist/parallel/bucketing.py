"""Gradient bucketing as torch's DDP does it: pure functions over sizes, dtypes and devices.

``compute_bucket_assignment_by_size`` returns what ``torch.distributed._compute_bucket_assignment_by_size``
(C++ ``compute_bucket_assignment_by_size`` in ``reducer.cpp``) returns for the same inputs, including
the order of buckets torch leaves unsorted. Inputs may be torch tensors, numpy arrays or
``TensorSpec`` descriptors; torch is never imported here.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np

from aiodist.errors import DistTypeError, DistValueError

__all__ = [
    "DEFAULT_FIRST_BUCKET_BYTES",
    "TensorSpec",
    "bucket_size_limits",
    "compute_bucket_assignment_by_size",
    "ddp_buckets",
    "reverse_order_buckets",
]

DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024
"""torch's ``dist._DEFAULT_FIRST_BUCKET_BYTES``: the cap of the bucket DDP fills first."""

_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What bucketing needs to know of one tensor, without the tensor.

    Attributes:
        nbytes: Size of the tensor's data in bytes (``numel * element_size``).
        dtype: A numpy dtype (or anything ``numpy.dtype`` accepts, ``ml_dtypes`` types included),
            a torch dtype, or a dtype name such as ``"float32"`` or ``"torch.bfloat16"``.
        device: ``"cpu"``, ``"cuda:1"``, ``"meta"``... or a ``torch.device``.
    """

    nbytes: int
    dtype: Any
    device: Any = "cpu"


TensorLike: TypeAlias = Any
"""A torch tensor, a numpy array or a ``TensorSpec``."""

# c10::ScalarType numbering (torch/headeronly/core/ScalarType.h). Bucket keys are hashed from these
# numbers, and the hash decides the order of the buckets torch leaves unsorted.
# fmt: off
_SCALAR_TYPES: dict[str, int] = {
    name: code
    for code, name in enumerate([
        "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64",
        "complex32", "complex64", "complex128", "bool", "qint8", "quint8", "qint32", "bfloat16",
        "quint4x2", "quint2x4", "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16",
        "float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz", "float8_e4m3fnuz",
        "uint16", "uint32", "uint64",
        "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
        "int1", "int2", "int3", "int4", "int5", "int6", "int7",
        "float8_e8m0fnu", "float4_e2m1fn_x2",
    ])
}

# c10::DeviceType numbering (torch/headeronly/core/DeviceType.h), by torch's device-type names.
_DEVICE_TYPES: dict[str, int] = {
    name: code
    for code, name in enumerate([
        "cpu", "cuda", "mkldnn", "opengl", "opencl", "ideep", "hip", "fpga", "maia", "xla",
        "vulkan", "metal", "xpu", "mps", "meta", "hpu", "ve", "lazy", "ipu", "mtia",
    ])
}
# fmt: on

# (scalar type, device type, device index); device index -1 means "no index", as in c10::Device.
_BucketKey: TypeAlias = tuple[int, int, int]


def bucket_size_limits(
    bucket_cap_mb: float, first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES
) -> list[int]:
    """The size limits torch's DDP hands to the bucket assignment at construction.

    DDP fills a small first bucket, then buckets of ``bucket_cap_mb``; the small one only exists
    while it really is smaller (torch's ``_BucketCapacityConfig.compute_bucket_size_limits``).

    Args:
        bucket_cap_mb: Bucket cap in MiB; converted as torch does, ``int(bucket_cap_mb * 2**20)``.
        first_bucket_bytes: Cap of the first bucket in bytes.

    Returns:
        ``[first_bucket_bytes, cap_bytes]`` if the first cap is the smaller one, else ``[cap_bytes]``.

    Raises:
        DistValueError: A negative cap.
    """
    cap_bytes = int(bucket_cap_mb * _MIB)
    if cap_bytes < 0 or first_bucket_bytes < 0:
        raise DistValueError(
            f"bucket caps must not be negative, got bucket_cap_mb={bucket_cap_mb}, "
            f"first_bucket_bytes={first_bucket_bytes}"
        )
    if first_bucket_bytes < cap_bytes:
        return [first_bucket_bytes, cap_bytes]
    return [cap_bytes]


def compute_bucket_assignment_by_size(
    tensors: Sequence[TensorLike],
    bucket_size_limits: Sequence[int],
    expect_sparse_gradient: Sequence[bool] | None = None,
    tensor_indices: Sequence[int] | None = None,
) -> tuple[list[list[int]], list[int]]:
    """Group tensors into buckets exactly as ``torch.distributed._compute_bucket_assignment_by_size``.

    How it works: tensors are visited in the given order. Each (dtype, device) pair has one open
    bucket and its own position in ``bucket_size_limits``. A tensor joins the open bucket of its
    pair; once that bucket holds at least the current limit, it is closed and that pair moves on to
    the next limit (the last one repeats). A tensor expecting a sparse gradient gets a bucket of its
    own, recorded with limit 0. Buckets still open at the end follow, in the iteration order of the
    ``std::unordered_map`` torch keeps them in (reproduced here). Without ``tensor_indices`` all
    buckets are then sorted by their smallest index; with them, torch assumes the tensors already
    come in gradient-ready order and does not sort.

    Args:
        tensors: Torch tensors (dense), numpy arrays (device ``"cpu"``) or ``TensorSpec``.
        bucket_size_limits: Byte limits, used in turn per (dtype, device); must not be empty.
        expect_sparse_gradient: Per tensor *index* (see ``tensor_indices``), whether its gradient
            will be sparse. ``None`` or empty: none will.
        tensor_indices: The index reported for ``tensors[i]``; ``None`` or empty: ``i``.

    Returns:
        ``(buckets, limits)``: lists of tensor indices, and for each bucket the size limit that was
        in force for it.

    Raises:
        DistValueError: No tensors, no limits, a negative limit, lengths that disagree, an index
            outside ``expect_sparse_gradient``, or a sparse torch tensor.
        DistTypeError: An object that is not a tensor, array or ``TensorSpec``, or a dtype or
            device torch does not know.
    """
    limits = [int(limit) for limit in bucket_size_limits]
    if not limits:
        raise DistValueError("bucket_size_limits must not be empty")
    if any(limit < 0 for limit in limits):
        raise DistValueError(f"bucket_size_limits must not be negative, got {limits}")
    described = [_describe(tensor, position) for position, tensor in enumerate(tensors)]
    if not described:
        raise DistValueError("cannot assign buckets to an empty list of tensors")
    sparse = [] if expect_sparse_gradient is None else [bool(flag) for flag in expect_sparse_gradient]
    if sparse and len(sparse) != len(described):
        raise DistValueError(f"expect_sparse_gradient has {len(sparse)} entries for {len(described)} tensors")
    # torch treats an empty tensor_indices as absent, and then sorts the buckets.
    given_indices = [] if tensor_indices is None else [int(i) for i in tensor_indices]
    presorted = bool(given_indices)
    indices = given_indices if presorted else list(range(len(described)))
    if len(indices) != len(described):
        raise DistValueError(f"tensor_indices has {len(indices)} entries for {len(described)} tensors")
    if sparse and any(not 0 <= index < len(sparse) for index in indices):
        raise DistValueError(f"tensor_indices {indices} fall outside expect_sparse_gradient")

    closed: list[tuple[list[int], int]] = []
    open_indices: dict[_BucketKey, list[int]] = {}
    open_bytes: dict[_BucketKey, int] = {}
    limit_position: dict[_BucketKey, int] = {}
    map_order = _UnorderedMapOrder()
    for index, (nbytes, key) in zip(indices, described, strict=True):
        if sparse and sparse[index]:
            # A sparse gradient cannot be flattened together with others; torch records limit 0.
            closed.append(([index], 0))
            continue
        if key not in open_indices:
            open_indices[key] = []
            open_bytes[key] = 0
            limit_position[key] = 0
            map_order.insert(key)
        open_indices[key].append(index)
        open_bytes[key] += nbytes
        limit = limits[limit_position[key]]
        if open_bytes[key] >= limit:
            closed.append((open_indices[key], limit))
            open_indices[key] = []
            open_bytes[key] = 0
            limit_position[key] = min(limit_position[key] + 1, len(limits) - 1)
    for key in map_order.ordered():
        if open_indices[key]:
            closed.append((open_indices[key], limits[limit_position[key]]))
    if not presorted:
        # Buckets are disjoint and non-empty, so the smallest indices are distinct: no ties.
        closed.sort(key=lambda bucket: min(bucket[0]))
    return [bucket for bucket, _ in closed], [limit for _, limit in closed]


def ddp_buckets(
    params: Sequence[TensorLike],
    bucket_cap_mb: float = 25.0,
    first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
    *,
    expect_sparse_gradient: Sequence[bool] | None = None,
    grad_ready_order: Sequence[int] | None = None,
) -> tuple[list[list[int]], list[int]]:
    """The buckets torch's DDP Reducer works with, in the Reducer's order (bucket 0 is reduced first).

    Without ``grad_ready_order``: the assignment ``DistributedDataParallel.__init__`` builds when it
    buckets at construction, i.e. with ``find_unused_parameters=True`` and ``static_graph=False``.
    The parameters go in model order (``_build_params_for_reducer``: ``named_modules`` then
    ``named_parameters(recurse=False)``, shared parameters once) to
    ``compute_bucket_assignment_by_size(params, bucket_size_limits(bucket_cap_mb,
    first_bucket_bytes), expect_sparse_gradient)``, and both returned lists are reversed before they
    reach the Reducer, because gradients arrive roughly in reverse model order. So bucket 0 holds the
    last parameters, and the small first-limit bucket holds the first parameters and is reduced last.

    With ``grad_ready_order`` (parameter indices in the order their gradients became ready during
    the first backward): the assignment the Reducer's ``rebuild_buckets`` makes after that backward,
    which is what torch uses from the second iteration on when ``find_unused_parameters=False``
    (its default) or ``static_graph=True``; at construction those modes use a single limit of
    ``sys.maxsize`` (one bucket per dtype and device). The rebuild calls
    ``compute_bucket_assignment_by_size`` on the parameters in ready order, with
    ``tensor_indices=grad_ready_order`` and limits ``[first_bucket_bytes, cap]`` taken literally,
    and neither sorts nor reverses: bucket 0 is the small one, holding the first-ready gradients.
    ``grad_ready_order = reversed(range(len(params)))`` gives the classic "reverse parameter order,
    first bucket small" layout.

    torch (2.x) uses the 1 MiB first bucket only when ``bucket_cap_mb`` is left at ``None``; an
    explicit ``bucket_cap_mb=X`` makes its first cap ``X`` too, which is
    ``first_bucket_bytes=int(X * 2**20)`` here.

    Args:
        params: The parameters requiring gradients, in model order; tensors, arrays or ``TensorSpec``.
        bucket_cap_mb: Cap of every bucket but the first, in MiB.
        first_bucket_bytes: Cap of the first bucket, in bytes.
        expect_sparse_gradient: Per parameter, whether its gradient is sparse (``nn.Embedding`` and
            ``nn.EmbeddingBag`` with ``sparse=True``).
        grad_ready_order: A permutation of ``range(len(params))``; see above.

    Returns:
        ``(buckets, limits)`` as ``compute_bucket_assignment_by_size`` returns them, in Reducer order.

    Raises:
        DistValueError: ``grad_ready_order`` is not a permutation of the parameter indices, or any
            reason of ``compute_bucket_assignment_by_size``.
        DistTypeError: As ``compute_bucket_assignment_by_size``.
    """
    if grad_ready_order is None:
        buckets, limits = compute_bucket_assignment_by_size(
            params, bucket_size_limits(bucket_cap_mb, first_bucket_bytes), expect_sparse_gradient
        )
        return buckets[::-1], limits[::-1]
    order = [int(i) for i in grad_ready_order]
    if sorted(order) != list(range(len(params))):
        raise DistValueError(f"grad_ready_order must be a permutation of range({len(params)}), got {order}")
    rebuild_limits = [first_bucket_bytes, int(bucket_cap_mb * _MIB)]
    return compute_bucket_assignment_by_size(
        [params[i] for i in order], rebuild_limits, expect_sparse_gradient, order
    )


def reverse_order_buckets(
    tensors: Sequence[TensorLike],
    bucket_cap_mb: float = 25.0,
    first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
) -> list[list[int]]:
    """The layout of aiodist's ``DistributedDataParallel`` and ``GradBucketer`` (SPEC §8).

    Tensors are taken in reverse order (gradients become ready roughly last layer first); the
    first bucket is capped at ``first_bucket_bytes`` when that is below the cap, every other at
    ``bucket_cap_mb``; one dtype and device per bucket. Bucket 0 is reduced first. This is the
    layout torch's DDP (``bucket_cap_mb=None``) arrives at after its first-iteration rebuild when
    gradients become ready in exactly reverse order: ``ddp_buckets(..., grad_ready_order=
    reversed(range(n)))`` with an explicit first cap.

    Returns:
        Tensor indices of each bucket, in reduction order.

    Raises:
        DistValueError, DistTypeError: as ``compute_bucket_assignment_by_size``.
    """
    order = list(reversed(range(len(tensors))))
    buckets, _ = compute_bucket_assignment_by_size(
        [tensors[i] for i in order],
        bucket_size_limits(bucket_cap_mb, first_bucket_bytes),
        tensor_indices=order,
    )
    return [list(b) for b in buckets]


def _describe(tensor: TensorLike, position: int) -> tuple[int, _BucketKey]:
    """Return ``(nbytes, bucket key)`` of one input."""
    if isinstance(tensor, TensorSpec):
        if isinstance(tensor.nbytes, bool) or not isinstance(tensor.nbytes, int) or tensor.nbytes < 0:
            raise DistValueError(f"tensor {position}: nbytes must be an int >= 0, got {tensor.nbytes!r}")
        return tensor.nbytes, (_scalar_type(tensor.dtype, position), *_device(tensor.device, position))
    if isinstance(tensor, np.ndarray):
        return int(tensor.nbytes), (_scalar_type(tensor.dtype, position), _DEVICE_TYPES["cpu"], -1)
    # A torch tensor can only exist if torch has been imported already; never import it ourselves.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(tensor, torch.Tensor):
        if tensor.is_sparse:
            raise DistValueError(f"tensor {position}: no support for sparse tensors")
        nbytes = int(tensor.numel()) * int(tensor.element_size())
        return nbytes, (_scalar_type(tensor.dtype, position), *_device(tensor.device, position))
    raise DistTypeError(
        f"tensor {position}: expected a torch tensor, a numpy array or a TensorSpec, "
        f"got {type(tensor).__name__}"
    )


def _scalar_type(dtype: Any, position: int) -> int:
    """Map a dtype (numpy, torch, or a name) to its c10::ScalarType number."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
    elif type(dtype).__module__ == "torch":
        name = str(dtype).removeprefix("torch.")
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError as exc:
            raise DistTypeError(f"tensor {position}: {dtype!r} is not a dtype") from exc
    code = _SCALAR_TYPES.get(name)
    if code is None and isinstance(dtype, str):
        # Aliases such as "f4", "half" or "double", spelled the numpy way.
        try:
            code = _SCALAR_TYPES.get(np.dtype(dtype).name)
        except TypeError:
            code = None
    if code is None:
        raise DistTypeError(f"tensor {position}: dtype {dtype!r} has no torch equivalent")
    return code


def _device(device: Any, position: int) -> tuple[int, int]:
    """Map ``"cuda:1"`` (or a ``torch.device``) to its c10 (device type, index); no index is -1."""
    text = str(device)
    kind, _, index_text = text.partition(":")
    code = _DEVICE_TYPES.get(kind)
    try:
        index = int(index_text) if index_text else -1
    except ValueError:
        code = None
    if code is None or not -1 <= index < 128:
        raise DistTypeError(f"tensor {position}: unknown device {text!r}")
    return code, index


_MASK64 = (1 << 64) - 1

# Bucket counts libstdc++'s std::unordered_map goes through as it grows (prime rehash policy,
# max load factor 1): 13 on the first insertion, then the first listed prime >= twice the count.
_BUCKET_COUNTS = (13, 29, 59, 127, 257, 541, 1109, 2357, 5087, 10273, 20753, 42043, 85229, 172933)


def _key_hash(key: _BucketKey) -> int:
    """torch's ``c10::get_hash(scalar_type, device)`` for a bucket key, as a 64-bit size_t."""
    scalar_type, device_type, device_index = key
    # std::hash<c10::Device>: (uint8 type << 16) | uint8 index, the identity as size_t.
    device_hash = ((device_type & 0xFF) << 16) | (device_index & 0xFF)
    # c10::hash_combine(seed=device hash, value=scalar type hash)
    mixed = (scalar_type + 0x9E3779B9 + ((device_hash << 6) & _MASK64) + (device_hash >> 2)) & _MASK64
    return device_hash ^ mixed


class _UnorderedMapOrder:
    """The iteration order of a libstdc++ ``std::unordered_map`` as keys are inserted.

    The map is one singly linked list in which the nodes of a hash bucket are adjacent. A key
    whose hash bucket already holds nodes goes in front of them; otherwise it goes to the head of
    the list. Growing re-inserts every node, in list order, under the new bucket count. torch
    leaves the buckets still open at the end in this order when it is told not to sort.
    """

    def __init__(self) -> None:
        self._nodes: list[tuple[int, _BucketKey]] = []
        self._bucket_count = 1

    def insert(self, key: _BucketKey) -> None:
        """Insert a key known to be absent."""
        if len(self._nodes) + 1 > self._capacity():
            self._bucket_count = self._grown_count()
            nodes, self._nodes = self._nodes, []
            for node in nodes:
                self._link(node)
        self._link((_key_hash(key), key))

    def ordered(self) -> list[_BucketKey]:
        """The keys in iteration order."""
        return [key for _, key in self._nodes]

    def _capacity(self) -> int:
        # Before the first insertion nothing is allocated (libstdc++'s _M_next_resize == 0).
        return 0 if self._bucket_count == 1 else self._bucket_count

    def _grown_count(self) -> int:
        for count in _BUCKET_COUNTS:
            if count > self._bucket_count:
                return count
        raise DistValueError(f"more than {_BUCKET_COUNTS[-1]} distinct (dtype, device) pairs")

    def _link(self, node: tuple[int, _BucketKey]) -> None:
        bucket = node[0] % self._bucket_count
        for position, (code, _) in enumerate(self._nodes):
            if code % self._bucket_count == bucket:
                self._nodes.insert(position, node)
                return
        self._nodes.insert(0, node)
