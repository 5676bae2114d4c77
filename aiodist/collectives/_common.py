"""Small helpers shared by the algorithms: chunk bounds, pipelined schedules, off-loop reductions."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from aiodist._tensors import byte_view
from aiodist.collectives import select
from aiodist.errors import DistValueError
from aiodist.ops import ReduceOp, finalize_inplace, reduce_inplace

__all__ = [
    "Array",
    "SlotReceives",
    "bounds",
    "bv",
    "check_size",
    "copy_into",
    "diagonal_order",
    "finalize",
    "finalize_soon",
    "n_segments",
    "reduce_into",
    "reduce_soon",
    "same_memory",
    "wait_all",
]

Array = npt.NDArray[Any]

_EMPTY = np.empty(0, np.uint8)


def bv(arr: Array) -> memoryview:
    """The flat byte view of a C-contiguous array (writable if the array is)."""
    return byte_view(arr) if arr.size else memoryview(bytearray(0))


def bounds(total: int, parts: int) -> list[int]:
    """Balanced split points of ``total`` elements into ``parts`` pieces (sizes differ by <= 1)."""
    return [i * total // parts for i in range(parts + 1)]


def n_segments(length: int, seg_elems: int) -> int:
    """How many pipeline segments a piece of ``length`` elements is cut into (at least 1)."""
    return max(1, -(-length // max(1, seg_elems)))


def diagonal_order(segments: int, steps: int) -> list[tuple[int, int]]:
    """(segment, step) pairs, diagonal by diagonal, newest segment last within a diagonal.

    Segment j's step t depends on its step t-1, which lies on the previous diagonal, so a
    rank can process (and forward) its incoming messages in this order while its peers send
    in the same order: a software pipeline of ``segments`` independent rings, ``steps`` deep.
    """
    order: list[tuple[int, int]] = []
    for d in range(segments + steps - 1):
        for t in range(min(d, steps - 1), -1, -1):
            j = d - t
            if j < segments:
                order.append((j, t))
    return order


def same_memory(a: Array, b: Array) -> bool:
    """True when ``a`` and ``b`` view exactly the same bytes (an in-place call)."""
    return bool(a.nbytes == b.nbytes and a.__array_interface__["data"][0] == b.__array_interface__["data"][0])


def copy_into(dst: Array, src: Array) -> None:
    """``dst[:] = src`` unless they already are the same memory."""
    if dst.size and not same_memory(dst, src):
        np.copyto(dst, src)


def check_size(what: str, got: int, want: int) -> None:
    """Raise before a byte is sent when an algorithm is handed buffers of the wrong size."""
    if got != want:
        raise DistValueError(f"{what}: expected {want} elements, got {got}")


async def reduce_into(op: ReduceOp, acc: Array, other: Array) -> None:
    """``acc = acc (op) other``; above a size threshold in a worker thread (numpy drops the GIL),
    so the event loop keeps reading sockets while a large segment is reduced, when the host
    has a core to spare (``select.offload_reduction``)."""
    if (w := reduce_soon(op, acc, other)) is not None:
        await w


def reduce_soon(op: ReduceOp, acc: Array, other: Array) -> asyncio.Future[None] | None:
    """``reduce_into`` for a stepped algorithm (``aiodist.collectives.steps``): done inline
    (None), or the future of the worker thread's reduction, for the next step to wait for."""
    # (on a blocking caller's thread, which runs no loop, inline: it holds up no loop there)
    if select.offload_reduction(acc.nbytes) and (loop := asyncio._get_running_loop()) is not None:
        return loop.run_in_executor(None, reduce_inplace, op, acc, other)
    reduce_inplace(op, acc, other)
    return None


def finalize_soon(op: ReduceOp, arr: Array, count: int) -> asyncio.Future[None] | None:
    """``finalize`` for a stepped algorithm, as ``reduce_soon``."""
    if op is not ReduceOp.AVG or count == 1 or not arr.size:
        return None
    if select.offload_reduction(arr.nbytes) and (loop := asyncio._get_running_loop()) is not None:
        return loop.run_in_executor(None, finalize_inplace, op, arr, count)
    finalize_inplace(op, arr, count)
    return None


async def finalize(op: ReduceOp, arr: Array, count: int) -> None:
    """AVG: divide by ``count`` (off the loop when large); other ops: nothing."""
    if (w := finalize_soon(op, arr, count)) is not None:
        await w


async def wait_all(aws: Iterable[Awaitable[Any]]) -> None:
    """Await every send/receive of a list (sends must finish before their buffer is reused)."""
    for aw in aws:
        await aw


class SlotReceives:
    """The receive schedule of a pipelined reduction: receives posted in schedule order, those
    that land in scratch taking one of ``count`` slots of ``length`` elements (the algorithm's
    only scratch), so a message always finds its buffer posted and the scratch stays bounded.

    Entry ``i`` of the schedule needs ``size(i)`` elements of scratch, or None when it is
    received straight into its final place; ``post(i, slot_view_or_None)`` posts its receive.
    Posting stops at the first entry that needs a slot while none is free; ``release`` gives a
    slot back (its data was used) and posts what then fits.
    """

    __slots__ = ("_free", "_next", "_post", "_posted", "_size", "_slot_of", "_total", "_views")

    def __init__(
        self,
        count: int,
        length: int,
        dtype: Any,
        total: int,
        size: Callable[[int], int | None],
        post: Callable[[int, Array | None], Awaitable[Any]],
    ) -> None:
        scratch = np.empty(count * length, dtype=dtype)
        self._views = [scratch[k * length : (k + 1) * length] for k in range(count)]
        self._free = list(range(count))
        self._total = total
        self._size = size
        self._post = post
        self._posted: dict[int, Awaitable[Any]] = {}
        self._slot_of: dict[int, int] = {}
        self._next = 0
        self._fill()

    def _fill(self) -> None:
        while self._next < self._total:
            i = self._next
            n = self._size(i)
            buf = None
            if n is not None:
                if not self._free:
                    return
                k = self._free.pop()
                self._slot_of[i] = k
                buf = self._views[k][:n]
            self._posted[i] = self._post(i, buf)
            self._next += 1

    async def arrived(self, i: int) -> int | None:
        """Wait for entry ``i``'s message; the slot it landed in (None: its final place)."""
        await self._posted.pop(i)
        return self._slot_of.pop(i, None)

    def view(self, k: int, n: int) -> Array:
        """The first ``n`` elements of slot ``k``."""
        return self._views[k][:n]

    def release(self, k: int) -> None:
        """Slot ``k``'s data has been used: post the receives that now fit."""
        self._free.append(k)
        self._fill()
