"""``GradBucketer``: DDP's gradient bucketing for plain numpy arrays, in asyncio code.

How it works: the arrays are split into buckets as DDP splits parameters (reverse order, a
1 MiB first bucket, then ``bucket_cap_mb``; one dtype per bucket). ``mark_ready(i)`` copies
array ``i`` (pre-scaled by 1/world size when averaging) into its slot of the bucket's flat
buffer; the moment a bucket is full its all_reduce starts, while the caller goes on computing
the next gradients. Buckets start in bucket order, so ranks that mark arrays in different orders
still issue the same sequence of collectives. ``await wait()`` awaits every bucket and writes
the results back into the arrays; the bucketer is then ready for the next round.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from aiodist import work as _work
from aiodist.errors import DistError, DistTypeError, DistValueError
from aiodist.face.world import resolve_group
from aiodist.parallel.bucketing import DEFAULT_FIRST_BUCKET_BYTES, reverse_order_buckets
from aiodist.work import Work

__all__ = ["GradBucketer"]

Array = npt.NDArray[Any]


class GradBucketer:
    """Average (or sum) numpy gradients across a group in buckets, as they become ready.

    Args:
        grads: the gradient arrays (C-contiguous, writable), in model order; results are written
            back into them by ``wait()``.
        group: the process group (None: the default group).
        bucket_cap_mb: cap of each bucket after the first one.
        first_bucket_bytes: cap of the first bucket (the one reduced first); the smaller of it
            and the cap is used.
        average: divide by the world size (floating dtypes only); False sums.

    Use it on the group's event loop: ``mark_ready`` starts collectives there.

    Raises:
        DistTypeError: an entry is not a C-contiguous writable numpy array, or ``average`` with
            a non-floating dtype.
        DistValueError: no arrays, or a negative cap.
    """

    def __init__(
        self,
        grads: Sequence[Array],
        group: Any = None,
        *,
        bucket_cap_mb: float = 25.0,
        first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
        average: bool = True,
    ) -> None:
        arrays = list(grads)
        if not arrays:
            raise DistValueError("GradBucketer needs at least one gradient array")
        for i, a in enumerate(arrays):
            if not isinstance(a, np.ndarray):
                raise DistTypeError(f"grads[{i}] must be a numpy array, got {type(a).__name__}")
            if not a.flags.c_contiguous or not a.flags.writeable:
                raise DistTypeError(f"grads[{i}] must be C-contiguous and writable")
            if average and not np.issubdtype(a.dtype, np.inexact) and a.dtype.name != "bfloat16":
                raise DistTypeError(
                    f"grads[{i}] has dtype {a.dtype.name}: averaging needs a floating dtype (pass average=False to sum)"
                )
        self._group = resolve_group(group)
        self._grads = arrays
        self._average = average
        self._buckets = reverse_order_buckets(arrays, bucket_cap_mb, first_bucket_bytes)
        self._flats: list[Array] = []
        self._slot: list[tuple[int, int, int]] = [(0, 0, 0)] * len(arrays)  # bucket, start, stop
        for b, indices in enumerate(self._buckets):
            offset = 0
            for i in indices:
                self._slot[i] = (b, offset, offset + arrays[i].size)
                offset += arrays[i].size
            self._flats.append(np.zeros(offset, dtype=arrays[indices[0]].dtype))
        self._reset()

    def _reset(self) -> None:
        self._ready = [False] * len(self._grads)
        self._pending = [len(b) for b in self._buckets]
        self._next = 0
        self._works: list[Work] = []

    @property
    def buckets(self) -> list[list[int]]:
        """Array indices of each bucket, in the order the buckets are reduced."""
        return [list(b) for b in self._buckets]

    def mark_ready(self, index: int) -> None:
        """Array ``index`` holds its final gradient: copy it into its bucket.

        If that fills the bucket (and every bucket before it has started), its all_reduce starts
        now. Modifying the array afterwards does not change what is sent.

        Raises:
            DistValueError: an index out of range, or one already marked in this round.
            DistError: called from a thread other than the group's event loop.
        """
        if isinstance(index, bool) or not isinstance(index, int | np.integer):
            raise DistTypeError(f"index must be an int, got {type(index).__name__}")
        if not 0 <= index < len(self._grads):
            raise DistValueError(f"index {index} out of range for {len(self._grads)} gradients")
        if self._ready[index]:
            raise DistValueError(f"gradient {index} was already marked ready in this round")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self._group.loop:
            raise DistError("GradBucketer.mark_ready must be called on the process group's event loop")
        self._ready[index] = True
        b, start, stop = self._slot[index]
        dst = self._flats[b][start:stop]
        src = self._grads[index].reshape(-1)
        if self._average and self._group.size > 1:
            np.multiply(src, src.dtype.type(1.0 / self._group.size), out=dst)
        else:
            dst[...] = src
        self._pending[b] -= 1
        while self._next < len(self._buckets) and self._pending[self._next] == 0:
            self._works.append(self._group.collective("all_reduce", self._flats[self._next]))
            self._next += 1

    async def wait(self) -> None:
        """Await every bucket's all_reduce and write the results into the arrays.

        Afterwards the next round may begin (``mark_ready`` again). Cancelling the waiting task
        leaves the operations running; the arrays then keep their local values.

        Raises:
            DistValueError: some arrays were never marked ready (named); the round is reset and
                the buckets that did start are awaited first.
            DistError: an all_reduce failed (timeout, lost peer...).
        """
        works, missing = self._works, [i for i, ready in enumerate(self._ready) if not ready]
        try:
            for w in works:
                await w
        finally:
            if missing or any(not w.is_success() for w in works):
                for w in works:  # the caller gets the first error; the others follow from it
                    _work.discard(w)
                self._reset()
        if missing:
            raise DistValueError(
                f"GradBucketer.wait(): gradients {', '.join(map(str, missing))} were never marked ready; "
                f"buckets {', '.join(map(str, range(self._next, len(self._buckets))))} were not reduced"
            )
        for i, (b, start, stop) in enumerate(self._slot):
            self._grads[i].reshape(-1)[...] = self._flats[b][start:stop]
        self._reset()
