"""Object collectives and object point-to-point of the async face.

Each object is serialised on its own: plain data (None, bool, int, float, str, bytes, numpy
arrays and dense CPU torch tensors, and lists, tuples and dicts of them) as msgpack (arrays,
tensors and tuples as extension types), anything else with pickle. The first byte of a
payload says which. Sizes travel first (one int64 per object), then the payloads, each
phase with the tensor algorithms of this package.

Security (SPEC §6): a pickled payload is decoded only when this job authenticates its
peers (``AIODIST_SECRET`` is set, so the transport holds a secret) or when
``AIODIST_ALLOW_PICKLE=1``. Otherwise it is refused with a ``DistError`` before a byte of
it is interpreted; msgpack payloads are always accepted (they cannot run code).
"""

from __future__ import annotations

import importlib
import pickle
import sys
from typing import Any

import msgpack
import numpy as np

from aiodist import _tensors
from aiodist._docs import ASYNC_OBJECTS, contract
from aiodist.backends.base import Op
from aiodist.backends.native import algorithm
from aiodist.collectives._common import Array, bv
from aiodist.collectives.gather import gather as _gather
from aiodist.collectives.gather import scatter as _scatter
from aiodist.collectives.steps import run
from aiodist.errors import DistError, DistTypeError, DistValueError
from aiodist.face.world import resolve_group
from aiodist.group import ProcessGroup
from aiodist.ops import SUPPORTED_DTYPE_NAMES, dtype_from_name, dtype_name
from aiodist.transport.base import P2P
from aiodist.work import Work

__all__ = [
    "all_gather_object",
    "broadcast_object_list",
    "decode_object",
    "encode_object",
    "gather_object",
    "pickle_allowed",
    "recv_object_list",
    "scatter_object_list",
    "send_object_list",
]


# (through the native backend's ``algorithm``: host-aware where the group's layout calls for it)
async def _broadcast(ctx: Any, arr: Array, root: int) -> None:
    await run(algorithm(ctx, Op("broadcast", outputs=(arr,), root=root)))


async def _allgather(ctx: Any, blocks: list[Array], inp: Array) -> None:
    await run(algorithm(ctx, Op("all_gather", outputs=tuple(blocks), inputs=(inp,))))


_MSGPACK = 0x4D  # "M"
_PICKLE = 0x50  # "P"
# msgpack ext codes for what msgpack has no type of, so that these travel without pickle:
_TUPLE = 1  # a tuple (msgpack alone would turn it into a list)
_NDARRAY = 2  # a numpy array: [dtype name, shape, bytes]
_TENSOR = 3  # a dense CPU torch.Tensor: [dtype name, shape, bytes, requires_grad]
_ARRAY_DTYPES = frozenset(dtype_from_name(name) for name in SUPPORTED_DTYPE_NAMES)

# Object point-to-point uses tags of its own (sizes, then payloads), so that a user's
# tag-0 traffic between the same pair can never take an object's payload.
SIZES_TAG = -0x0B1EC7
DATA_TAG = -0x0B1EC8


def _default(obj: Any) -> Any:
    kind = type(obj)
    if kind is tuple:
        return msgpack.ExtType(_TUPLE, _pack(list(obj)))
    if kind is np.ndarray and obj.dtype in _ARRAY_DTYPES:
        return msgpack.ExtType(_NDARRAY, _pack([dtype_name(obj.dtype), list(obj.shape), obj.tobytes()]))
    if _is_plain_tensor(obj):
        data = obj.detach().resolve_conj().resolve_neg().contiguous()
        raw = _tensors.as_array(data, arg="tensor", writable=False).tobytes()
        return msgpack.ExtType(
            _TENSOR,
            _pack([dtype_name(_tensors.numpy_dtype_for(obj.dtype)), list(obj.shape), raw, obj.requires_grad]),
        )
    raise TypeError(f"not plain data: {kind.__qualname__}")


def _is_plain_tensor(obj: Any) -> bool:
    """A plain dense CPU ``torch.Tensor`` (not a subclass such as ``Parameter``: those keep pickle)."""
    torch = sys.modules.get("torch")
    return (
        torch is not None
        and type(obj) is torch.Tensor
        and obj.layout is torch.strided
        and obj.device.type == "cpu"
        and _dtype_name_or_none(obj) is not None
    )


def _dtype_name_or_none(tensor: Any) -> str | None:
    try:
        return dtype_name(_tensors.numpy_dtype_for(tensor.dtype))
    except (DistTypeError, DistValueError):
        return None


def _array_from(name: str, shape: list[int], raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=dtype_from_name(name)).reshape(shape).copy()


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, strict_types=True, use_bin_type=True)  # type: ignore[no-any-return]


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _TUPLE:
        return tuple(_unpack(data))
    if code == _NDARRAY:
        name, shape, raw = _unpack(data)
        return _array_from(name, shape, raw)
    if code == _TENSOR:
        name, shape, raw, requires_grad = _unpack(data)
        try:
            importlib.import_module("torch")
        except ImportError:
            raise DistError(
                "an object payload holds a torch tensor, but torch is not installed here"
            ) from None
        tensor = _tensors.to_torch(_array_from(name, shape, raw))
        return tensor.requires_grad_(True) if requires_grad else tensor
    raise DistError(f"unknown msgpack extension {code} in an object payload")


def _unpack(data: bytes | memoryview) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_ext_hook, use_list=True)


def encode_object(obj: Any) -> bytes:
    """msgpack for plain data, pickle for the rest; the first byte says which."""
    try:
        return bytes([_MSGPACK]) + _pack(obj)
    except (TypeError, ValueError, OverflowError):
        return bytes([_PICKLE]) + pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def pickle_allowed(group: ProcessGroup) -> bool:
    """Pickles are accepted from authenticated peers, or when the user opted in."""
    if group.transport.settings.allow_pickle:  # AIODIST_ALLOW_PICKLE=1, when the job started
        return True
    return getattr(group.transport, "secret", None) is not None


def decode_object(payload: bytes | memoryview, *, src: int, allow_pickle: bool, what: str) -> Any:
    """Decode one payload from global rank ``src``; refuse a pickle unless ``allow_pickle``.

    Raises:
        DistError: a refused pickle (never unpickled) or a malformed payload.
    """
    view = memoryview(payload)
    if not view.nbytes:
        raise DistError(f"{what}: rank {src} sent an empty object payload")
    kind, body = view[0], view[1:]
    if kind == _MSGPACK:
        try:
            return _unpack(body)
        except DistError:
            raise
        except Exception as exc:
            raise DistError(f"{what}: rank {src} sent a malformed msgpack object payload: {exc}") from exc
    if kind == _PICKLE:
        if not allow_pickle:
            raise DistError(
                f"{what}: rank {src} sent an object that is not plain data (it needs pickle), and pickled "
                "payloads are accepted only from authenticated peers; set the same AIODIST_SECRET on every "
                "rank, or AIODIST_ALLOW_PICKLE=1 if every peer is trusted. The payload was not unpickled."
            )
        return pickle.loads(body)
    raise DistError(f"{what}: rank {src} sent an object payload of unknown kind {kind}")


def _encode_all(objs: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """(sizes as int64, all payloads concatenated as uint8)."""
    payloads = [encode_object(o) for o in objs]
    sizes = np.array([len(p) for p in payloads], dtype=np.int64)
    data = np.frombuffer(b"".join(payloads), dtype=np.uint8) if payloads else np.empty(0, np.uint8)
    return sizes, data


def _decode_all(data: np.ndarray, sizes: np.ndarray, *, src: int, allow: bool, what: str) -> list[Any]:
    out, start = [], 0
    raw = bv(data)
    for s in sizes.tolist():
        out.append(decode_object(raw[start : start + s], src=src, allow_pickle=allow, what=what))
        start += s
    return out


def _check_sizes(g: ProcessGroup, sizes: np.ndarray, src: int, what: str) -> None:
    """Refuse sizes no honest peer sends, before anything of that size is allocated
    (``AIODIST_MAX_OBJECT_BYTES``: the most one rank may announce in one object collective)."""
    if sizes.size and int(sizes.min()) < 0:
        raise DistError(f"{what}: rank {src} announced a negative object size")
    total = int(sizes.sum()) if sizes.size else 0
    limit = g.transport.settings.max_object_bytes
    if total > limit:
        raise DistError(
            f"{what}: rank {src} announced {total} bytes of objects, over the limit of {limit} "
            "(raise AIODIST_MAX_OBJECT_BYTES if that is intended)"
        )


def _list_arg(obj: Any, arg: str) -> list[Any]:
    if not isinstance(obj, list):
        raise DistTypeError(f"{arg} must be a list, got {type(obj).__qualname__}")
    return obj


def _member(group: Any, what: str) -> ProcessGroup:
    g = resolve_group(group)
    g.check_usable(what)
    return g


def _offsets(sizes: list[int]) -> list[int]:
    offs = [0]
    for s in sizes:
        offs.append(offs[-1] + s)
    return offs


def _start(g: ProcessGroup, name: str, count: int, root: int, coro_fn: Any, timeout: float | None) -> Work:
    return g.run_collective(name, coro_fn, timeout, dtype="object", count=count, root=root)


# -- collectives ----------------------------------------------------------------------------


@contract(ASYNC_OBJECTS)
def broadcast_object_list(
    object_list: list[Any], src: int = 0, group: Any = None, *, timeout: float | None = None
) -> Work:
    """Replace the items of ``object_list`` with those of global rank ``src``'s list (same length).

    Args:
        object_list: on ``src`` the objects (picklable); elsewhere a list as long, filled in place.
        src: the source's global rank (default 0).
        group: the group (default: the world).
        timeout: seconds for this operation instead of the group's timeout.
    Returns:
        A ``Work``, at once: await it (or ``wait()`` from another thread); its result is None.
    """
    g = _member(group, "broadcast_object_list")
    objs = _list_arg(object_list, "object_list")
    root = g.group_rank(src, "src")
    what = "broadcast_object_list"
    allow = pickle_allowed(g)

    async def run(ctx: Any) -> None:
        if g.rank == root:
            sizes, data = _encode_all(objs)
        else:
            sizes = np.zeros(len(objs), dtype=np.int64)
        await _broadcast(ctx, sizes, root)
        _check_sizes(g, sizes, src, what)
        if g.rank != root:
            data = np.empty(int(sizes.sum()), dtype=np.uint8)
        await _broadcast(ctx, data, root)
        if g.rank != root:
            objs[:] = _decode_all(data, sizes, src=src, allow=allow, what=what)

    return _start(g, what, len(objs), src, run, timeout)


@contract(ASYNC_OBJECTS)
def all_gather_object(
    object_list: list[Any], obj: Any, group: Any = None, *, timeout: float | None = None
) -> Work:
    """``object_list[i]`` = group rank i's ``obj`` (``object_list`` has one slot per member).

    Args:
        object_list: one slot per member, filled in place.
        obj: this rank's object (picklable).
        group: the group (default: the world).
        timeout: seconds for this operation instead of the group's timeout.
    Returns:
        A ``Work``, at once: await it (or ``wait()`` from another thread); its result is None.
    """
    g = _member(group, "all_gather_object")
    out = _list_arg(object_list, "object_list")
    if len(out) != g.size:
        raise DistValueError(f"object_list must have one slot per group member ({g.size}), got {len(out)}")
    what = "all_gather_object"
    allow = pickle_allowed(g)

    async def run(ctx: Any) -> None:
        mine = np.frombuffer(encode_object(obj), dtype=np.uint8)
        sizes = np.zeros(g.size, dtype=np.int64)
        await _allgather(ctx, [sizes[i : i + 1] for i in range(g.size)], np.array([mine.size], np.int64))
        for i in range(g.size):
            _check_sizes(g, sizes[i : i + 1], g.ranks[i], what)
        offs = _offsets(sizes.tolist())
        data = np.empty(offs[-1], dtype=np.uint8)
        blocks = [data[offs[i] : offs[i + 1]] for i in range(g.size)]
        await _allgather(ctx, blocks, mine)
        for i in range(g.size):
            raw = bv(blocks[i])
            out[i] = decode_object(raw, src=g.ranks[i], allow_pickle=allow or i == g.rank, what=what)

    return _start(g, what, g.size, -1, run, timeout)


@contract(ASYNC_OBJECTS)
def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int = 0,
    group: Any = None,
    *,
    timeout: float | None = None,
) -> Work:
    """Collect every member's ``obj`` into ``object_gather_list`` on global rank ``dst``.

    Args:
        obj: this rank's object (picklable).
        object_gather_list: on ``dst``, one slot per member; elsewhere None.
        dst: the destination's global rank (default 0).
        group: the group (default: the world).
        timeout: seconds for this operation instead of the group's timeout.
    Returns:
        A ``Work``, at once: await it (or ``wait()`` from another thread); its result is None.
    """
    g = _member(group, "gather_object")
    root = g.group_rank(dst, "dst")
    out: list[Any] | None = None
    if g.rank == root:
        if object_gather_list is None:
            raise DistValueError("gather_object: object_gather_list is required on the destination rank")
        out = _list_arg(object_gather_list, "object_gather_list")
        if len(out) != g.size:
            raise DistValueError(
                f"object_gather_list must have one slot per group member ({g.size}), got {len(out)}"
            )
    what = "gather_object"
    allow = pickle_allowed(g)

    async def run(ctx: Any) -> None:
        mine = np.frombuffer(encode_object(obj), dtype=np.uint8)
        sizes = np.zeros(g.size, dtype=np.int64)
        size_blocks = [sizes[i : i + 1] for i in range(g.size)] if out is not None else None
        await _gather(ctx, np.array([mine.size], np.int64), size_blocks, root)
        if out is None:
            await _gather(ctx, mine, None, root, uniform=False)
            return
        for i in range(g.size):
            _check_sizes(g, sizes[i : i + 1], g.ranks[i], what)
        offs = _offsets(sizes.tolist())
        data = np.empty(offs[-1], dtype=np.uint8)
        blocks = [data[offs[i] : offs[i + 1]] for i in range(g.size)]
        await _gather(ctx, mine, blocks, root, uniform=False)
        for i in range(g.size):
            raw = bv(blocks[i])
            out[i] = decode_object(raw, src=g.ranks[i], allow_pickle=allow or i == g.rank, what=what)

    return _start(g, what, 0, dst, run, timeout)


@contract(ASYNC_OBJECTS)
def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int = 0,
    group: Any = None,
    *,
    timeout: float | None = None,
) -> Work:
    """``scatter_object_output_list[0]`` on member i = ``scatter_object_input_list[i]`` of global rank ``src``.

    Args:
        scatter_object_output_list: at least one slot; its first is written.
        scatter_object_input_list: on ``src``, one object per member; elsewhere None.
        src: the source's global rank (default 0).
        group: the group (default: the world).
        timeout: seconds for this operation instead of the group's timeout.
    Returns:
        A ``Work``, at once: await it (or ``wait()`` from another thread); its result is None.
    """
    g = _member(group, "scatter_object_list")
    root = g.group_rank(src, "src")
    out = _list_arg(scatter_object_output_list, "scatter_object_output_list")
    if not out:
        # torch's wording (torch programs match it): the first slot receives this rank's object.
        raise DistValueError("Expected argument scatter_object_output_list to be a list of size at least 1.")
    ins: list[Any] | None = None
    if g.rank == root:
        if scatter_object_input_list is None:
            raise DistValueError(
                "scatter_object_list: scatter_object_input_list is required on the source rank"
            )
        ins = _list_arg(scatter_object_input_list, "scatter_object_input_list")
        if len(ins) != g.size:
            raise DistValueError(
                f"scatter_object_input_list must have one object per group member ({g.size}), got {len(ins)}"
            )
    what = "scatter_object_list"
    allow = pickle_allowed(g)

    async def run(ctx: Any) -> None:
        size = np.zeros(1, dtype=np.int64)
        if ins is not None:
            sizes, data = _encode_all(ins)
            offs = _offsets(sizes.tolist())
            await _scatter(ctx, size, [sizes[i : i + 1] for i in range(g.size)], root)
            blocks = [data[offs[i] : offs[i + 1]] for i in range(g.size)]
            mine = np.empty(int(size[0]), dtype=np.uint8)
            await _scatter(ctx, mine, blocks, root, uniform=False)
        else:
            await _scatter(ctx, size, None, root)
            _check_sizes(g, size, src, what)
            mine = np.empty(int(size[0]), dtype=np.uint8)
            await _scatter(ctx, mine, None, root, uniform=False)
        raw = bv(mine)
        out[0] = decode_object(raw, src=src, allow_pickle=allow or ins is not None, what=what)

    return _start(g, what, 0, src, run, timeout)


# -- point-to-point -----------------------------------------------------------------------------


@contract(ASYNC_OBJECTS)
def send_object_list(
    object_list: list[Any], dst: int, group: Any = None, *, timeout: float | None = None
) -> Work:
    """Send the objects of ``object_list`` to global rank ``dst`` (which calls ``recv_object_list``
    with a list of the same length). Both messages are queued at once, in call order.

    Args:
        object_list: the objects (picklable).
        dst: the receiver's global rank.
        group: the group (default: the world).
        timeout: seconds for this operation instead of the group's timeout.
    Returns:
        A ``Work``, at once: await it (or ``wait()`` from another thread); its result is None.
    """
    g = resolve_group(group)
    objs = _list_arg(object_list, "object_list")
    sizes, data = _encode_all(objs)
    first = g.send(sizes, dst, tag=SIZES_TAG, timeout=timeout)
    second = g.send(data, dst, tag=DATA_TAG, timeout=timeout)

    async def run() -> None:
        await first
        await second

    return g.start(f"send_object_list to rank {dst}", (g.gid, P2P, DATA_TAG), run(), timeout)


@contract(ASYNC_OBJECTS)
def recv_object_list(
    object_list: list[Any], src: int | None = None, group: Any = None, *, timeout: float | None = None
) -> Work:
    """Fill ``object_list`` with the objects a ``send_object_list`` of global rank ``src`` (None:
    any member) sent; the Work's result is the sender's global rank.

    Args:
        object_list: as long as the sender's, filled in place.
        src: the sender's global rank (None: any member).
        group: the group (default: the world).
        timeout: seconds for this operation instead of the group's timeout.
    Returns:
        A ``Work``, at once: await it (or ``wait()`` from another thread); its result is
        the sender's global rank.
    """
    g = resolve_group(group)
    objs = _list_arg(object_list, "object_list")
    sizes = np.zeros(len(objs), dtype=np.int64)
    first = g.recv(sizes, src, tag=SIZES_TAG, timeout=timeout)
    allow = pickle_allowed(g)

    async def run() -> int:
        sender = int(await first)
        _check_sizes(g, sizes, sender, "recv_object_list")
        data = np.empty(int(sizes.sum()), dtype=np.uint8)
        await g.recv(data, sender, tag=DATA_TAG, timeout=timeout)
        objs[:] = _decode_all(data, sizes, src=sender, allow=allow, what="recv_object_list")
        return sender

    who = "any rank" if src is None else f"rank {src}"
    return g.start(f"recv_object_list from {who}", (g.gid, P2P, DATA_TAG), run(), timeout)
