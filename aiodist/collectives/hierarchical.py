"""Hierarchical collectives for a group spread over hosts, with several ranks on some host.

As NCCL and Horovod do: each host's ranks work among themselves (over shared memory when the
transport has it, where the one-host direct algorithms run), and only one rank per host, its
leader (its lowest group rank), talks to the other hosts. Each phase is the flat (or direct)
algorithm run on a sub-group of the operation (``OpContext.sub``): the phases share the
operation's key, and a pair of ranks that meets in two phases sends and posts the first
phase's messages before the second's, so they never mix.

- all_reduce: reduce to the leader on each host, all_reduce among the leaders, broadcast on
  each host. The network carries the buffer once per host instead of once per rank. AVG
  sums in every phase and divides by the group size once, on the leaders.
- broadcast: the root stands for its host: root -> the other hosts' leaders -> their ranks,
  and on the root's host root -> its ranks.
- reduce: the mirror: reduce to each host's head (the root on its host, the leader elsewhere),
  then among the heads to the root. A head that is not the root reduces into a copy: only the
  root's buffer is written.
- all_gather: gather to the leader on each host, all_gather of whole hosts among the leaders,
  broadcast of the whole result on each host. Through one staging buffer laid out host by
  host, or straight in the output when it is one buffer whose hosts are contiguous ranks.
- barrier: each host's ranks check in with their leader, the leaders run a barrier, the
  leaders release their ranks.

Large buffers take the pipelined flat algorithms instead, on the group's ranks put in host
order (each host's ranks together, the root's host first with the root at its head): the ring
of all_reduce and all_gather and the chains of broadcast and reduce then cross from one host
to the next only once per host, as NCCL's rings do, while every segment still streams through
every rank at once (the phases above would run one after the other over the whole buffer).
Where the group's ranks already come host by host this is the flat algorithm itself.

Two-level forms, for large buffers where every host holds L > 1 ranks that share memory (the
i-th ranks of the hosts form lane i):

- all_reduce: a direct reduce-scatter on each host (rank i ends with shard i of its host's
  sum), an all_reduce of shard i along lane i, a direct all_gather on each host. A link
  between two hosts carries the buffer once each way, a host-ordered ring 1.5 times (2 x 2).
- all_gather: an all_gather along each lane, then each host's ranks share what their lanes
  brought (a direct all_gather per host of the lanes' blocks).
- reduce_scatter: each host's ranks reduce, for every host k, the blocks of host k's ranks
  (rank i keeps the sum for the i-th rank of host k), then a reduce_scatter along each lane.

The lanes' phases run at once on every lane, so a host's L ranks share its link.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

from aiodist.collectives import allgather as _allgather
from aiodist.collectives import allreduce as _allreduce
from aiodist.collectives import barrier as _barrier
from aiodist.collectives import broadcast as _broadcast
from aiodist.collectives import direct, select
from aiodist.collectives import gather as _gather
from aiodist.collectives import reduce as _reduce
from aiodist.collectives import reduce_scatter as _reduce_scatter
from aiodist.collectives._common import Array, bounds, bv, copy_into, finalize, wait_all
from aiodist.collectives.context import OpContext
from aiodist.collectives.steps import drive, run
from aiodist.collectives.topology import HostMap
from aiodist.ops import ReduceOp

__all__ = [
    "two_level_allgather",
    "two_level_allreduce",
    "two_level_reduce_scatter",
    "host_ordered_allgather",
    "host_ordered_allreduce",
    "host_ordered_broadcast",
    "host_ordered_reduce",
    "hierarchical_allgather",
    "hierarchical_allreduce",
    "hierarchical_barrier",
    "hierarchical_broadcast",
    "hierarchical_reduce",
]

_EMPTY = memoryview(b"")

log = logging.getLogger("aiodist")

#: How the log names the pipelined flat algorithms run on the ranks in host order.
HOST_ORDERED = "host-ordered"


def note(ctx: OpContext, what: str, how: str) -> None:
    """Log at DEBUG level which host-aware form runs ``what`` (see ``aiodist.collectives.hostaware``)."""
    if log.isEnabledFor(logging.DEBUG):
        fp = ctx.fp or ["collective", "?"]
        hosts = ctx.hosts.n_hosts if ctx.hosts is not None else 1
        where = "on one host" if hosts == 1 else f"over {hosts} hosts"
        log.debug(
            "aiodist: rank %d: %s #%s: %s %s %s (%d ranks)",
            ctx.ranks[ctx.rank], fp[0], fp[1], what, how, where, ctx.size,
        )  # fmt: skip


async def _host_broadcast(local: OpContext, arr: Array, root: int) -> None:
    """Broadcast among the ranks of one host: the direct form where ``select.host_algorithm``
    picks it for them (shared memory), the flat one otherwise. (The other phases need no such
    choice: reduce has no direct form, and the groups of one rank per host are flat.)"""
    if select.host_algorithm("broadcast", arr.nbytes, local) == "direct":
        note(local, "broadcast", "direct")
        await drive(direct.direct_broadcast_steps(local, arr, root))
    else:
        await run(_broadcast.broadcast(local, arr, root))


def _hosts(ctx: OpContext) -> HostMap:
    hosts = ctx.hosts
    if hosts is None:  # the dispatchers only come here with a host map
        raise AssertionError("hierarchical collective without a host map")
    return hosts


def _phase_op(op: ReduceOp) -> ReduceOp:
    """The reduction of every phase: AVG sums, and divides once at the end."""
    return ReduceOp.SUM if op is ReduceOp.AVG else op


def _heads(hosts: HostMap, root: int) -> list[int]:
    """One rank per host in host order: the root on its host, the leader elsewhere."""
    heads = list(hosts.leaders)
    heads[hosts.host_of[root]] = root
    return heads


async def hierarchical_allreduce(ctx: OpContext, arr: Array, op: ReduceOp) -> None:
    hosts = _hosts(ctx)
    local = hosts.members[hosts.host_of[ctx.rank]]
    step = _phase_op(op)
    if len(local) > 1:
        await run(_reduce.reduce(ctx.sub(local), arr, step, 0))
    if ctx.rank == local[0]:
        await run(_allreduce.allreduce(ctx.sub(hosts.leaders), arr, step))
        await finalize(op, arr, ctx.size)
    if len(local) > 1:
        await _host_broadcast(ctx.sub(local), arr, 0)


async def hierarchical_broadcast(ctx: OpContext, arr: Array, root: int) -> None:
    hosts = _hosts(ctx)
    heads = _heads(hosts, root)
    h = hosts.host_of[ctx.rank]
    local = hosts.members[h]
    if ctx.rank == heads[h]:
        await run(_broadcast.broadcast(ctx.sub(heads), arr, hosts.host_of[root]))
    if len(local) > 1:
        await _host_broadcast(ctx.sub(local), arr, local.index(heads[h]))


async def hierarchical_reduce(ctx: OpContext, arr: Array, op: ReduceOp, root: int) -> None:
    hosts = _hosts(ctx)
    heads = _heads(hosts, root)
    h = hosts.host_of[ctx.rank]
    local = hosts.members[h]
    head = ctx.rank == heads[h]
    step = _phase_op(op)
    # A head that is not the root folds its host into a copy: only the root's buffer is written.
    acc = arr.copy() if head and ctx.rank != root and len(local) > 1 else arr
    if len(local) > 1:
        await run(_reduce.reduce(ctx.sub(local), acc, step, local.index(heads[h])))
    if head:
        await run(_reduce.reduce(ctx.sub(heads), acc, step, hosts.host_of[root]))
    if ctx.rank == root:
        await finalize(op, arr, ctx.size)


async def hierarchical_allgather(ctx: OpContext, blocks: Sequence[Array], inp: Array) -> None:
    _allgather.check_allgather(ctx, blocks, inp)
    hosts = _hosts(ctx)
    r = ctx.rank
    h = hosts.host_of[r]
    local = hosts.members[h]
    leader = r == local[0]
    sizes = [b.size for b in blocks]
    offsets: dict[int, int] = {}
    starts = [0]
    for members in hosts.members:
        for g in members:
            offsets[g] = starts[-1] + sum(sizes[m] for m in members if m < g)
        starts.append(starts[-1] + sum(sizes[m] for m in members))
    staging = _as_one_buffer(blocks) if hosts.contiguous() else None
    in_place = staging is not None
    if staging is None:
        staging = np.empty(starts[-1], dtype=inp.dtype)

    def view(g: int) -> Array:
        return staging[offsets[g] : offsets[g] + sizes[g]]

    if len(local) > 1:
        uniform = all(sizes[g] == sizes[local[0]] for g in local)
        outs = [view(g) for g in local] if leader else None
        await _gather.gather(ctx.sub(local), inp, outs, 0, uniform=uniform)
    else:
        copy_into(view(r), inp)
    if leader and hosts.n_hosts > 1:
        bundles = [staging[starts[k] : starts[k + 1]] for k in range(hosts.n_hosts)]
        await run(_allgather.allgather(ctx.sub(hosts.leaders), bundles, bundles[h]))
    if len(local) > 1:
        await _host_broadcast(ctx.sub(local), staging, 0)
    if not in_place:
        for g, b in enumerate(blocks):
            copy_into(b, view(g))
    else:
        copy_into(blocks[r], inp)  # (in place already unless the input is a buffer of its own)


def _as_one_buffer(blocks: Sequence[Array]) -> Array | None:
    """The output blocks as one array when they lie back to back in memory (an all_gather into
    one tensor), else None. Every byte of the view belongs to one of the blocks."""
    if not blocks or any(b.size == 0 or not b.flags.writeable for b in blocks):
        return None
    first = blocks[0]
    at = first.__array_interface__["data"][0]
    for b in blocks:
        if (
            b.dtype != first.dtype
            or b.ndim != 1
            or not b.flags.c_contiguous
            or b.__array_interface__["data"][0] != at
        ):
            return None
        at += b.nbytes
    total = sum(b.size for b in blocks)
    return as_strided(first, shape=(total,), strides=(first.itemsize,), writeable=True)


async def hierarchical_barrier(ctx: OpContext) -> None:
    hosts = _hosts(ctx)
    local = hosts.members[hosts.host_of[ctx.rank]]
    leader = local[0]
    if ctx.rank != leader:
        await ctx.send(leader, _EMPTY)
        await ctx.recv(leader, memoryview(bytearray(0)))
        return
    await wait_all([ctx.recv(g, memoryview(bytearray(0))) for g in local[1:]])
    await drive(_barrier.barrier_steps(ctx.sub(hosts.leaders)))
    await wait_all([ctx.send(g, _EMPTY) for g in local[1:]])


# -- large buffers: the pipelined flat algorithms on the ranks in host order --------------------------


def host_order(hosts: HostMap, first: int | None = None) -> list[int]:
    """The group's ranks host by host; with ``first``, its host leads and it leads its host."""
    lead = 0 if first is None else hosts.host_of[first]
    order = []
    for k in range(hosts.n_hosts):
        members = list(hosts.members[(lead + k) % hosts.n_hosts])
        if k == 0 and first is not None:
            members.remove(first)
            members.insert(0, first)
        order += members
    return order


async def host_ordered_allreduce(ctx: OpContext, arr: Array, op: ReduceOp) -> None:
    await _allreduce.ring_allreduce(ctx.sub(host_order(_hosts(ctx))), arr, op)


async def host_ordered_broadcast(ctx: OpContext, arr: Array, root: int) -> None:
    await _broadcast.chain_broadcast(ctx.sub(host_order(_hosts(ctx), root)), arr, 0)


async def host_ordered_reduce(ctx: OpContext, arr: Array, op: ReduceOp, root: int) -> None:
    await _reduce.chain_reduce(ctx.sub(host_order(_hosts(ctx), root)), arr, op, 0)


async def host_ordered_allgather(ctx: OpContext, blocks: Sequence[Array], inp: Array) -> None:
    _allgather.check_allgather(ctx, blocks, inp)  # (before the blocks are put in host order)
    order = host_order(_hosts(ctx))
    await _allgather.ring_allgather(ctx.sub(order), [blocks[g] for g in order], inp)


# -- large buffers, the same number of ranks on every host: the two-level forms ---------------------


def _lane(hosts: HostMap, r: int) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
    """Group rank ``r``'s host (its ranks), its place i on it, and lane i (the i-th rank of
    every host, in host order)."""
    local = hosts.members[hosts.host_of[r]]
    i = local.index(r)
    return local, i, tuple(m[i] for m in hosts.members)


def _chunks(nbytes: int) -> int:
    """How many chunks a two-level operation of ``nbytes`` is cut into (``select.TWO_LEVEL_CHUNK_BYTES``)."""
    return max(1, min(select.TWO_LEVEL_MAX_CHUNKS, nbytes // select.TWO_LEVEL_CHUNK_BYTES))


async def _pipeline(
    chunks: int,
    across: Callable[[int], Awaitable[None]],
    before: Callable[[int], Awaitable[None]] | None = None,
    after: Callable[[int], Awaitable[None]] | None = None,
) -> None:
    """Run each chunk's phases in order, ``before(c)`` (on the host), ``across(c)`` (along the
    lane), ``after(c)`` (on the host), chunks overlapping: while chunk c crosses to the other
    hosts, chunk c + 1 is reduced on the host and chunk c - 1 shared there.

    The phases on the host run one at a time in one order on every rank (``before(c + 1)``
    ahead of ``after(c)``), so that the messages of a pair of one host keep one order at both
    ends; the lane's run one at a time in chunk order. The two sides share no pair of ranks.
    """
    loop = asyncio.get_running_loop()
    ready = [loop.create_future() for _ in range(chunks)]  # before(c) is done
    crossed = [loop.create_future() for _ in range(chunks)]  # across(c) is done

    async def on_host() -> None:
        for c in range(chunks + 1):
            if before is not None and c < chunks:
                await before(c)
            if c < chunks:
                ready[c].set_result(None)
            if after is not None and c > 0:
                await crossed[c - 1]
                await after(c - 1)

    async def along_lane() -> None:
        for c in range(chunks):
            await ready[c]
            await across(c)
            crossed[c].set_result(None)

    tasks = [loop.create_task(on_host()), loop.create_task(along_lane())]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            t.result()  # the first failure (the other side is cancelled below)
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def two_level_allreduce(ctx: OpContext, arr: Array, op: ReduceOp) -> None:
    local, i, lane = _lane(_hosts(ctx), ctx.rank)
    n_local = len(local)
    step = _phase_op(op)
    chunks = _chunks(arr.nbytes)
    shard = arr.size // (n_local * chunks)  # elements of one rank's shard of one chunk
    length = shard * n_local

    def parts(c: int) -> list[Array]:
        return [arr[(c * n_local + k) * shard : (c * n_local + k + 1) * shard] for k in range(n_local)]

    on_host, on_lane = ctx.sub(local), ctx.sub(lane)

    async def before(c: int) -> None:
        await direct.direct_reduce_scatter(on_host, parts(c)[i], parts(c), step)

    async def across(c: int) -> None:
        mine = parts(c)[i]
        await run(_allreduce.allreduce(on_lane, mine, step))
        await finalize(op, mine, ctx.size)

    async def after(c: int) -> None:
        await drive(direct.direct_allgather_steps(on_host, parts(c), parts(c)[i]))

    await _pipeline(chunks, across, before, after)
    if length * chunks < arr.size:  # the last size % (L x chunks) elements, among all ranks
        await run(_allreduce.allreduce(ctx, arr[length * chunks :], op))


async def two_level_allgather(ctx: OpContext, blocks: Sequence[Array], inp: Array) -> None:
    _allgather.check_allgather(ctx, blocks, inp)
    hosts = _hosts(ctx)
    local, i, lane = _lane(hosts, ctx.rank)
    chunks = _chunks(inp.nbytes * ctx.size)
    cut = bounds(inp.size, chunks)
    on_host, on_lane = ctx.sub(local), ctx.sub(lane)
    n_local = len(local)
    peers = [(i + k) % n_local for k in range(1, n_local)]

    def piece(a: Array, c: int) -> Array:
        return a[cut[c] : cut[c + 1]]

    async def across(c: int) -> None:
        await run(_allgather.allgather(on_lane, [piece(blocks[g], c) for g in lane], piece(inp, c)))

    async def after(c: int) -> None:
        # Each rank shares what its lane brought with the others of its host, host by host: a
        # pair's messages are posted and sent in that one order at both ends.
        recvs = [on_host.recv(p, bv(piece(blocks[m[p]], c))) for m in hosts.members for p in peers]
        sends = [on_host.send(p, bv(piece(blocks[m[i]], c))) for m in hosts.members for p in peers]
        await wait_all(recvs)
        await wait_all(sends)

    await _pipeline(chunks, across, after=after)


async def two_level_reduce_scatter(ctx: OpContext, out: Array, blocks: Sequence[Array], op: ReduceOp) -> None:
    hosts = _hosts(ctx)
    local, _, lane = _lane(hosts, ctx.rank)
    step = _phase_op(op)
    chunks = _chunks(out.nbytes * ctx.size)
    cut = bounds(out.size, chunks)
    on_host, on_lane = ctx.sub(local), ctx.sub(lane)
    # sums[k]: this host's sum of the blocks of host k's i-th rank.
    sums = [np.empty_like(out) for _ in hosts.members]

    def piece(a: Array, c: int) -> Array:
        return a[cut[c] : cut[c + 1]]

    async def before(c: int) -> None:
        for k, members in enumerate(hosts.members):
            await direct.direct_reduce_scatter(
                on_host, piece(sums[k], c), [piece(blocks[g], c) for g in members], step
            )

    async def across(c: int) -> None:
        await _reduce_scatter.reduce_scatter(on_lane, piece(out, c), [piece(sk, c) for sk in sums], step)
        await finalize(op, piece(out, c), ctx.size)

    await _pipeline(chunks, across, before)
