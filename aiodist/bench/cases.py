"""What each benchmarked operation moves, how its bandwidth is counted, and how its result is checked.

Sizes follow nccl-tests: ``size`` is the bytes of the operation's larger buffer (the
all-reduced tensor, all_gather's output, reduce_scatter's input, ...), ``count`` its
elements. ``algbw = size / time``; ``busbw = algbw * factor`` with nccl-tests' factors, so
that busbw is comparable with the link's bandwidth whatever the algorithm.

Buffers are numpy arrays (torch tensors for the torch-facing implementations are views of
the same memory), filled with small integers so that every float32 sum is exact and a
result can be checked element by element (``#wrong``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "COLLECTIVES",
    "LATENCY",
    "ROOTED",
    "Buffers",
    "busbw_factor",
    "check",
    "count_for",
    "fill",
    "make_buffers",
]

Array = npt.NDArray[np.float32]

#: collectives of the size sweep, in table order.
COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "gather",
    "scatter",
    "sendrecv",
)
#: latency rows: (case, bytes). ``pingpong``: one-way time of an 8 B round trip / 2;
#: ``stream``: time per message of a burst of 8 B sends.
LATENCY = (("all_reduce", 4), ("barrier", 0), ("pingpong", 8), ("stream", 8))

#: operations with a root (rank 0 in the benchmark); the others print root -1 as nccl-tests.
ROOTED = frozenset({"broadcast", "reduce", "gather", "scatter"})
_BLOCKED = frozenset({"all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"})
_REDUCING = frozenset({"all_reduce", "reduce", "reduce_scatter"})


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor of ``op`` on ``n`` ranks."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in _BLOCKED:
        return (n - 1) / n
    return 1.0


def redop(op: str) -> str:
    return "sum" if op in _REDUCING else "none"


def count_for(op: str, nbytes: int, n: int, itemsize: int = 4) -> int:
    """Elements of the operation's larger buffer for a requested size (a multiple of ``n``
    for operations made of one block per rank)."""
    count = max(1, nbytes // itemsize)
    if op in _BLOCKED:
        count = max(n, count - count % n)
    return count


class Buffers:
    """The arrays of one operation on one rank: ``a`` (in / in-place), ``b`` (out, if any)."""

    __slots__ = ("a", "b", "blocks_a", "blocks_b")

    def __init__(self, a: Array, b: Array | None, n: int) -> None:
        self.a = a
        self.b = b
        self.blocks_a = _split(a, n)
        self.blocks_b = _split(b, n) if b is not None else []


def _split(arr: Array, n: int) -> list[Array]:
    if arr.size % n:
        return [arr]
    blk = arr.size // n
    return [arr[i * blk : (i + 1) * blk] for i in range(n)]


def make_buffers(op: str, count: int, rank: int, n: int) -> Buffers:
    """Allocate (and touch) the buffers of ``op`` for ``count`` elements on ``rank``."""
    blk = count // n if op in _BLOCKED else count
    if op in ("all_reduce", "broadcast", "reduce"):
        return Buffers(np.zeros(count, np.float32), None, n)
    if op in ("all_gather", "gather"):
        return Buffers(np.zeros(blk, np.float32), np.zeros(count, np.float32), n)
    if op in ("reduce_scatter", "scatter"):
        return Buffers(np.zeros(count, np.float32), np.zeros(blk, np.float32), n)
    if op in ("all_to_all", "sendrecv"):
        return Buffers(np.zeros(count, np.float32), np.zeros(count, np.float32), n)
    if op in ("barrier",):
        return Buffers(np.zeros(0, np.float32), None, n)
    if op in ("pingpong", "stream"):
        return Buffers(np.zeros(max(1, count), np.float32), None, n)
    raise ValueError(f"unknown benchmark case {op!r}")


def _pattern(rank: int, start: int, size: int) -> Array:
    """Rank ``rank``'s value of elements start..start+size-1: small exact integers."""
    k = np.arange(start, start + size, dtype=np.int64)
    return ((rank + 1) + 8 * (k % 5)).astype(np.float32)


def fill(op: str, bufs: Buffers, rank: int, n: int) -> None:
    """Put this rank's input in place (and poison outputs) before a checked call."""
    a = bufs.a
    if op in ("broadcast", "scatter"):
        a[:] = _pattern(0, 0, a.size) if rank == 0 else -1.0
    else:
        a[:] = _pattern(rank, 0, a.size)
    if bufs.b is not None:
        bufs.b[:] = -1.0


def _sum_pattern(n: int, start: int, size: int) -> Array:
    k = np.arange(start, start + size, dtype=np.int64)
    return (n * (n + 1) // 2 + 8 * n * (k % 5)).astype(np.float32)


def expected(op: str, bufs: Buffers, rank: int, n: int) -> tuple[Array, Array] | None:
    """(the array to check, what it must hold) on ``rank``; None when nothing is defined there."""
    a, b = bufs.a, bufs.b
    if op == "all_reduce" or (op == "reduce" and rank == 0):
        return a, _sum_pattern(n, 0, a.size)
    if op == "broadcast":
        return a, _pattern(0, 0, a.size)
    if op == "all_gather" or (op == "gather" and rank == 0):
        assert b is not None
        blk = a.size
        return b, np.concatenate([_pattern(j, 0, blk) for j in range(n)])
    if op == "reduce_scatter":
        assert b is not None
        return b, _sum_pattern(n, rank * b.size, b.size)
    if op == "scatter":
        assert b is not None
        return b, _pattern(0, rank * b.size, b.size)
    if op == "all_to_all":
        assert b is not None
        blk = a.size // n
        return b, np.concatenate([_pattern(j, rank * blk, blk) for j in range(n)])
    if op == "sendrecv":
        assert b is not None
        return b, _pattern((rank - 1) % n, 0, b.size)
    return None


def check(op: str, bufs: Buffers, rank: int, n: int) -> int:
    """How many elements of this rank's result are wrong (nccl-tests' ``#wrong``)."""
    pair = expected(op, bufs, rank, n)
    if pair is None:
        return 0
    got, want = pair
    return int(np.count_nonzero(got != want))


def describe(op: str) -> dict[str, Any]:
    return {"type": "float", "redop": redop(op), "root": 0 if op in ROOTED else -1}
