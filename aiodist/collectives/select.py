"""Which algorithm runs for which message size and group size, and the measured switch points.

Every choice depends only on values that are equal on all ranks of a well-formed call
(byte count of the operation, group size), so all ranks pick the same algorithm; a call
whose ranks disagree on sizes is caught by the fingerprint of its first message.

Measured on the development machine: 2 cores, loopback TCP, uvloop, 2 and 4 processes
(4 processes oversubscribe the 2 cores), shared with other jobs, so figures are the best of
5-15 interleaved runs, in ms per call on rank 0 (/tmp script, not kept).

all_reduce float32, total bytes: recursive doubling / segmented ring::

    bytes     2 ranks          4 ranks
    64 KiB    0.18 / 0.43      0.91 / 1.5
    256 KiB   0.30 / 0.30      0.83 / 1.4
    1 MiB     0.55 / 0.76      4.0  / 2.8
    4 MiB     5.0  / 4.4       14.7 / 15.2
    16 MiB    17.6 / 21.5      73 / 79 (medians 137 / 83; an earlier run 187 / 74)
    -> ring from 1 MiB (it also needs no full-size scratch, recursive doubling does).
    Ring segment at 64 MiB, 2 / 4 ranks: 256 KiB 272 / 460, 512 KiB 163 / 402,
    1 MiB 116 / 318, 4 MiB 75 / 349 -> 1 MiB. Receive slots 2 / 4 / 8: within noise
    (64 MiB, 4 ranks: 411 / 377 / 347) -> 4. Reductions in a worker thread from 64 KiB /
    256 KiB / never: 4 MiB on 4 ranks 30 / 25 / 37, on 2 ranks 15.7 / 14.6 / 10.5 -> off
    the loop from 512 KiB (below that a reduction takes < 0.1 ms on the loop).

broadcast, total bytes: binomial tree / pipelined chain (4 ranks; on 2 they are the
same single transfer)::

    64 KiB 0.075 / 0.065, 256 KiB 0.11 / 0.08, 1 MiB 0.30 / 0.20, 4 MiB 3.5 / 0.71,
    16 MiB 24.5 / 8.8  -> chain from 256 KiB with 3+ ranks.

reduce, total bytes: binomial tree / chain with credits::

    2 ranks: 1 MiB 0.72 / 0.91, 4 MiB 2.7 / 2.7, 16 MiB 12.7 / 10.2
    4 ranks: 1 MiB 2.0 / 2.1,   4 MiB 7.3 / 9.2, 16 MiB 21.6 / 23.2 (medians 27 / 41)
    -> chain from 4 MiB: the tree is as fast up to there, but it holds two full-size
    copies on every non-root rank, the chain four segments.

all_gather, bytes per rank: Bruck / ring::

    2 ranks: 4 KiB 0.077 / 0.077, 64 KiB 0.10 / 0.09, 1 MiB 0.60 / 0.50
    4 ranks: 4 KiB 0.16 / 0.30,   64 KiB 0.55 / 0.33, 1 MiB 3.3 / 2.3
    -> ring from 64 KiB per rank.

reduce_scatter, total input bytes: direct / ring::

    2 ranks: 256 KiB 0.14 / 0.12, 1 MiB 0.19 / 0.29, 4 MiB 1.3 / 1.2, 16 MiB 8.7 / 6.7
    4 ranks: 256 KiB 0.57 / 0.89, 1 MiB 0.65 / 0.53, 4 MiB 6.5 / 8.4, 16 MiB 22.6 / 27.8
    -> ring from 1 MiB: close in time, and direct stages (n-1)/n of the input.

gather, bytes per rank: binomial tree / direct::

    4 ranks: 4 KiB 0.26 / 0.08, 64 KiB 0.43 / 0.10, 1 MiB 0.73 / 0.45 (2 ranks: equal)
    -> direct at every size measured; the tree is kept for groups of 16+ ranks with
    blocks under 16 KiB, where n-1 messages converging on the root cost more than
    log2(n) rounds (not measurable on this machine).

Host-aware choices (``host_algorithm``) follow the group's layout over hosts, not a size: the
direct forms on one host with shared memory, the hierarchical ones across hosts with several
ranks on some host, each switching to its pipelined form at the flat switch points above.

One host over shared memory (a trial merge with the shared-memory transport, same machine,
load 6-8 from other jobs; best of 15 / 7 calls, two interleaved runs, /tmp scripts not kept),
all_reduce float32 flat (recursive doubling below 1 MiB, ring above) / direct, ms::

    2 ranks: 64 KiB 0.15-0.56 / 0.17-0.76, 256 KiB 0.49-0.58 / 0.52-1.0, 1 MiB 1.0-1.2 /
             1.0-1.4, 4 MiB 2.5 / 1.3-2.7, 16 MiB 8.5-15.5 / 11-15, 64 MiB 83 / 55
    4 ranks: 64 KiB 0.29-0.55 / 1.3-2.7, 256 KiB 1.7-1.9 / 2.5, 1 MiB 4.4-8.8 / 2.6-10.9,
             4 MiB 7.4-7.7 / 7.0-8.2, 16 MiB 42-50 / 30-41
    -> direct from 1 MiB (``DIRECT_ALLREDUCE_BYTES``): below, two rounds of messages to every
    peer cost more than recursive doubling's log2(n) exchanges. 2 ranks, 64 MiB, flat / direct:
    all_gather 60 / 40, broadcast 6-16 / 13-15 (the same single transfer on 2 ranks).

Over TCP (no shared memory: 4 processes over loopback on the 2 cores, load 14-17): told they
are two hosts of two, all_reduce 4 B 255-270 µs hierarchical against 100-110 µs flat, 64 KiB
370-570 / 150-230 µs; 16 MiB 80 / 190 ms (the same ring in host order: noise). One host with
the direct forms forced, 2 ranks: all_gather 64 MiB per rank 970 / 570 ms flat, all_reduce 64
MiB 267 / 228 ms -> without shared memory the direct forms are not chosen. The gain of the
phases across real hosts cannot be measured on one machine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiodist.runtime import host as _host

if TYPE_CHECKING:
    from aiodist.collectives.context import OpContext

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
    "TWO_LEVEL",
    "TWO_LEVEL_CHUNK_BYTES",
    "TWO_LEVEL_MAX_CHUNKS",
    "TREE_GATHER_MIN_RANKS",
    "THREAD_REDUCE_BYTES",
    "allgather_algorithm",
    "allreduce_algorithm",
    "broadcast_algorithm",
    "gather_algorithm",
    "HOST_ALGOS_ENV",
    "DIRECT_ALLREDUCE_BYTES",
    "DIRECT_DEPTH",
    "IN_TURN_BYTES",
    "host_algorithm",
    "offload_reduction",
    "reduce_algorithm",
    "reduce_scatter_algorithm",
    "segment_elems",
]

#: all_reduce: recursive doubling below, segmented ring at and above (total bytes).
ALLREDUCE_RING_BYTES = 1024 * 1024
#: broadcast: binomial tree below, pipelined chain at and above (total bytes).
BCAST_CHAIN_BYTES = 256 * 1024
#: reduce: binomial tree below, pipelined chain at and above (total bytes).
REDUCE_CHAIN_BYTES = 4 * 1024 * 1024
#: all_gather: Bruck below, ring at and above (bytes contributed per rank).
ALLGATHER_RING_BYTES = 64 * 1024
#: reduce_scatter: direct exchange below, ring at and above (total input bytes per rank).
REDUCE_SCATTER_RING_BYTES = 1024 * 1024
#: gather / scatter: binomial tree below this block size in groups of TREE_GATHER_MIN_RANKS+.
TREE_GATHER_BYTES = 16 * 1024
TREE_GATHER_MIN_RANKS = 16
#: pipeline segment of the ring, chain and reduce algorithms.
SEGMENT_BYTES = 1024 * 1024
#: receive slots (each one segment) of the pipelined reductions: the op's only scratch.
RING_SLOTS = 4
#: reductions of at least this many bytes run in a worker thread (when ``offload_reduction``).
THREAD_REDUCE_BYTES = 512 * 1024

RD_ALLREDUCE = "recursive doubling"


def offload_reduction(nbytes: int) -> bool:
    """Run a reduction of ``nbytes`` in a worker thread (True) or inline on the loop?

    A worker thread lets the loop read sockets while numpy adds, but only pays when the host
    has a core to spare for it: with as many ranks as cores (2 cores here) the hop (a thread
    wake-up, the GIL hand-over, a loop wake-up) is pure cost. Measured, 64 MiB all_reduce on
    4 ranks: 157 ms (71 ms CPU per rank) offloaded, 125 ms (58 ms) inline; 16 MiB on 2 ranks:
    24.7 ms offloaded, 20.1 ms inline. Ranks on this host: see ``aiodist.runtime.host.local_ranks``.
    """
    return nbytes >= THREAD_REDUCE_BYTES and _host.has_spare_core()


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
    return "tree" if size >= TREE_GATHER_MIN_RANKS and block_bytes < TREE_GATHER_BYTES else "direct"


# -- host-aware choices (aiodist.collectives.hostaware) -------------------------------------

#: ``AIODIST_HOST_ALGOS``, which every rank of a job must set alike (the rendezvous checks it and
#: the transport holds it): ``auto`` (the default): direct algorithms on a group whose ranks share
#: one host and reach each other through shared memory, hierarchical ones on a group spread over
#: hosts with several ranks on some host; ``flat``: neither; ``direct``: the direct algorithms on
#: every group on one host, whatever carries its data (tests, measurements).
HOST_ALGOS_ENV = "AIODIST_HOST_ALGOS"
#: all_reduce on one host: recursive doubling below, direct reduce-scatter + all-gather at and above
#: (measured over shared memory: see above).
DIRECT_ALLREDUCE_BYTES = 1024 * 1024
#: segments of the direct reductions in flight at once (each takes size - 1 segments of scratch).
DIRECT_DEPTH = 2
#: Reductions (all_reduce, reduce, reduce_scatter) of at least this many bytes, on a group whose
#: ranks reach each other through shared memory, start only once the group's previous one has
#: ended (``ProcessGroup._in_turn``). Run together they interleave their segments, and each
#: one's data has likely left the caches by the time it is reduced. Measured (2 vCPUs, async
#: face, a gather of k reductions, 8 alternating repetitions each, medians, together / in turn):
#: 2 ranks, all_reduce 4 x 16 MiB 22.1 / 13.5 ms, 8 x 4 MiB 25.2 / 12.0, 16 x 1 MiB 14.2 / 5.8;
#: reduce_scatter 4 x 16 MiB 26.2 / 14.7, reduce 14.8 / 9.9; 4 ranks, all_reduce 4 x 16 MiB
#: 69.3 / 58.1, reduce_scatter 42.1 / 35.9. Copies gain nothing from taking turns (all_gather
#: 19.5 / 19.7 ms, 4 ranks 92.8 / 92.4) or lose (broadcast 6.6 / 7.2), so they keep running
#: together, as do small operations (latency).
IN_TURN_BYTES = 1024 * 1024

#: The host-aware operations: those with a direct (one host) and a hierarchical form.
_DIRECT_OPS = frozenset({"all_reduce", "broadcast", "all_gather", "reduce_scatter"})
_HIERARCHICAL_OPS = frozenset({"all_reduce", "broadcast", "all_gather", "reduce", "barrier"})


#: The two-level forms across hosts (``aiodist.collectives.hierarchical``): where every host
#: holds as many ranks, more than one, that share memory, large reductions and gathers run
#: among each host's ranks and, in between, among the i-th ranks of the hosts, so that each
#: host's link carries what the hosts exchange (an all_reduce's buffer once each way between
#: two hosts) instead of a ring's (n - 1) / n of it per rank. From the flat rings' switch points.
TWO_LEVEL = "two-level"
#: The two-level forms cut a buffer into chunks of about this size (at most TWO_LEVEL_MAX_CHUNKS)
#: and overlap them: while one chunk crosses to the other hosts, the next is reduced on the host
#: and the previous one shared there.
TWO_LEVEL_CHUNK_BYTES = 4 * 1024 * 1024
TWO_LEVEL_MAX_CHUNKS = 16


def _two_level(op: str, nbytes: int, ctx: OpContext) -> bool:
    hosts = ctx.hosts
    if hosts is None or not hosts.uniform or not ctx.shares_memory():
        return False
    match op:
        case "all_reduce":
            return nbytes >= ALLREDUCE_RING_BYTES
        case "all_gather":  # (bytes per rank)
            return nbytes >= ALLGATHER_RING_BYTES
        case "reduce_scatter":  # (total input bytes)
            return nbytes >= REDUCE_SCATTER_RING_BYTES
    return False


def host_algorithm(op: str, nbytes: int, ctx: OpContext) -> str:
    """``"direct"``, ``"hierarchical"``, ``"two-level"`` or ``"flat"`` for operation ``op`` of
    ``nbytes`` on ``ctx``'s group.

    Depends only on facts equal on every rank: the group's host map, whether its members reach
    the others of their host through shared memory, and ``AIODIST_HOST_ALGOS``, all three
    agreed on at rendezvous (``transport.mesh``), the operation and its size.
    """
    hosts = ctx.hosts
    if hosts is None or ctx.size == 1:
        return "flat"
    mode = ctx.transport.host_algos
    if mode == "flat":
        return "flat"
    if hosts.layered:
        if _two_level(op, nbytes, ctx):
            return TWO_LEVEL
        return "hierarchical" if op in _HIERARCHICAL_OPS else "flat"
    if not hosts.one_host or op not in _DIRECT_OPS:
        return "flat"
    if op == "all_reduce" and nbytes < DIRECT_ALLREDUCE_BYTES:
        return "flat"
    return "direct" if mode == "direct" or ctx.shares_memory() else "flat"
