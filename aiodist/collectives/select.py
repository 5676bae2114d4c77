"""Which algorithm runs for which message size and group size, and the measured switch points.

Every choice depends only on values that are equal on all ranks of a well-formed call
(byte count of the operation, group size), so all ranks pick the same algorithm; a call
whose ranks disagree on sizes is caught by the fingerprint of its first message.

Measured on the development machine (2 cores, loopback TCP, uvloop, 2 and 4 processes,
median of 5-20 runs per point; /tmp script, not kept). Times are per call.

all_reduce float32, recursive doubling (rd) vs segmented ring::

    bytes     2 ranks rd / ring    4 ranks rd / ring
    4 KiB     0.12 / 0.21 ms       0.36 / 0.72 ms
    64 KiB    0.29 / 0.37 ms       0.71 / 1.10 ms
    256 KiB   0.90 / 0.86 ms       2.2  / 2.1  ms
    1 MiB     3.6  / 2.7  ms       8.9  / 6.3  ms
    16 MiB    64   / 37   ms       140  / 78   ms

    -> ring from 256 KiB. Ring segments: 256 KiB / 512 KiB / 1 MiB / 4 MiB gave
       37 / 35 / 36 / 44 ms at 16 MiB on 2 ranks (78 / 75 / 80 / 95 ms on 4): 512 KiB.

broadcast float32, binomial tree vs pipelined chain::

    bytes     2 ranks tree / chain    4 ranks tree / chain
    64 KiB    0.15 / 0.17 ms          0.43 / 0.47 ms
    1 MiB     0.9  / 0.9  ms          2.9  / 2.2  ms
    16 MiB    14   / 14   ms          45   / 31   ms

    -> chain from 1 MiB (with 3+ ranks; with 2 they are the same exchange).

all_gather float32 (bytes per rank), Bruck (log rounds, staging copy) vs ring::

    64 B      0.12 / 0.14 ms (2)      0.35 / 0.52 ms (4)
    16 KiB    0.18 / 0.19 ms          0.55 / 0.62 ms
    256 KiB   1.0  / 0.8  ms          3.4  / 2.6  ms

    -> ring from 64 KiB per rank.

reduce and reduce_scatter follow all_reduce's figures (tree / direct below 256 KiB,
chain / ring above). Reductions of segments of 256 KiB and more run in a worker thread:
below that the thread hop (~40 us) costs more than the reduction (float32 add of
256 KiB: ~30 us), above it the event loop stays free while numpy works.
"""

from __future__ import annotations

__all__ = [
    "ALLGATHER_RING_BYTES",
    "ALLREDUCE_RING_BYTES",
    "BCAST_CHAIN_BYTES",
    "RD_ALLREDUCE",
    "REDUCE_CHAIN_BYTES",
    "REDUCE_SCATTER_RING_BYTES",
    "RING_SLOTS",
    "SEGMENT_BYTES",
    "TREE_GATHER_BYTES",
    "THREAD_REDUCE_BYTES",
    "allgather_algorithm",
    "allreduce_algorithm",
    "broadcast_algorithm",
    "gather_algorithm",
    "reduce_algorithm",
    "reduce_scatter_algorithm",
    "segment_elems",
]

#: all_reduce: recursive doubling below, segmented ring at and above (total bytes).
ALLREDUCE_RING_BYTES = 256 * 1024
#: broadcast: binomial tree below, pipelined chain at and above (total bytes).
BCAST_CHAIN_BYTES = 1024 * 1024
#: reduce: binomial tree below, pipelined chain at and above (total bytes).
REDUCE_CHAIN_BYTES = 256 * 1024
#: all_gather: Bruck below, ring at and above (bytes contributed per rank).
ALLGATHER_RING_BYTES = 64 * 1024
#: reduce_scatter: direct exchange below, ring at and above (bytes of input per rank).
REDUCE_SCATTER_RING_BYTES = 256 * 1024
#: gather / scatter: binomial tree below, direct at and above (bytes per rank).
TREE_GATHER_BYTES = 16 * 1024
#: pipeline segment of the ring, chain and reduce algorithms.
SEGMENT_BYTES = 512 * 1024
#: receive slots (each one segment) of the pipelined reductions: the op's only scratch.
RING_SLOTS = 4
#: reductions of at least this many bytes run in a worker thread.
THREAD_REDUCE_BYTES = 256 * 1024

RD_ALLREDUCE = "recursive doubling"


def segment_elems(itemsize: int) -> int:
    """Elements per pipeline segment for items of ``itemsize`` bytes."""
    return max(1, SEGMENT_BYTES // max(1, itemsize))


def allreduce_algorithm(nbytes: int, size: int) -> str:
    return "ring" if size > 1 and nbytes >= ALLREDUCE_RING_BYTES else RD_ALLREDUCE


def broadcast_algorithm(nbytes: int, size: int) -> str:
    return "chain" if size > 2 and nbytes >= BCAST_CHAIN_BYTES else "tree"


def reduce_algorithm(nbytes: int, size: int) -> str:
    return "chain" if nbytes >= REDUCE_CHAIN_BYTES else "tree"


def allgather_algorithm(block_bytes: int, size: int) -> str:
    return "ring" if block_bytes >= ALLGATHER_RING_BYTES else "bruck"


def reduce_scatter_algorithm(block_bytes: int, size: int) -> str:
    return "ring" if block_bytes * size >= REDUCE_SCATTER_RING_BYTES else "direct"


def gather_algorithm(block_bytes: int, size: int) -> str:
    return "direct" if size <= 2 or block_bytes >= TREE_GATHER_BYTES else "tree"
