"""DDP's communication: hops onto the runtime loop, coalesced broadcast, the construction exchange.

DDP runs in the user's thread (forward, ``backward()``, the optimizer) while every operation of
the runtime lives on the group's event loop: the sync face's loop thread, or an asyncio
program's loop when DDP is driven from a worker thread (``asyncio.to_thread``). Blocking calls
hop onto the loop and wait; the gradient hooks only *post* work to it
(``loop.call_soon_threadsafe``), so backward never waits for the loop. Posts from one thread
run in the order they were made, which keeps the call order of collectives equal on all ranks.
"""

from __future__ import annotations

import asyncio
import struct
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from aiodist.collectives.context import OpContext
from aiodist.errors import DistError, DistTimeoutError, name_ranks
from aiodist.group import ProcessGroup
from aiodist.ops import ReduceOp
from aiodist.parallel.bucketing import compute_bucket_assignment_by_size
from aiodist.runtime.loop_thread import block_on, on_loop
from aiodist.runtime.origin import mark_thread

__all__ = [
    "BROADCAST_BUCKET_BYTES",
    "MAX_BROADCASTS_IN_FLIGHT",
    "all_reduce_future",
    "broadcast_coalesced",
    "exchange_bytes",
    "post",
    "run_blocking",
]

T = TypeVar("T")

BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024
"""Size cap of one flattened broadcast of module state (torch's ``broadcast_bucket_size``)."""

MAX_BROADCASTS_IN_FLIGHT = 2
"""Coalesced broadcasts in flight at once: bounds the extra memory to two flat buckets."""


def run_blocking(group: ProcessGroup, make: Callable[[], Coroutine[Any, Any, T]], what: str) -> T:
    """Run the coroutine ``make()`` on the group's loop and block this thread for its result.

    Raises:
        DistError: called on the loop's own thread (it would wait for itself), or whatever the
            coroutine raises.
    """
    return block_on(
        group.loop,
        make(),
        lambda: DistError(
            f"{what} waits for the other ranks and cannot run on the runtime's event-loop thread; "
            "use aiodist.sync, or call it from another thread (await asyncio.to_thread(...))"
        ),
    )


def post(group: ProcessGroup, fn: Callable[[], None]) -> None:
    """Run ``fn()`` on the group's loop soon, without waiting (at once when already on it)."""
    if on_loop(group.loop):
        fn()
    else:
        mark_thread()  # (``fn`` runs in a copy of this thread's context: its collectives carry its name)
        group.loop.call_soon_threadsafe(fn)


def all_reduce_future(tensor: Any, group: ProcessGroup, op: ReduceOp = ReduceOp.SUM) -> Any:
    """Start an in-place all_reduce of ``tensor`` from any thread; a ``torch.futures.Future`` of it.

    The operation is posted to the loop (this call does not wait for the loop); the future
    completes with ``tensor`` itself, or with the operation's error, on the loop thread.
    """
    import torch

    fut: Any = torch.futures.Future()

    def settle(done: Any) -> None:
        exc = done.exception()
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(tensor)

    def start() -> None:
        try:
            work = group.collective("all_reduce", tensor, op)
        except BaseException as exc:
            fut.set_exception(exc)
            return
        work.get_future().add_done_callback(settle)

    post(group, start)
    return fut


async def broadcast_coalesced(
    tensors: Sequence[Any],
    group: ProcessGroup,
    src: int,
    bucket_bytes: int = BROADCAST_BUCKET_BYTES,
) -> None:
    """Broadcast torch tensors from global rank ``src`` in flattened buckets (run on the loop).

    How it works: the tensors are grouped by dtype into buckets of at most ``bucket_bytes``
    (``compute_bucket_assignment_by_size``); the source flattens each bucket into one tensor,
    the others allocate an empty one, and one broadcast moves it. At most
    ``MAX_BROADCASTS_IN_FLIGHT`` buckets are in flight: before a third starts, the oldest is
    awaited and copied back into its tensors.
    """
    import torch

    live = [t for t in tensors if t.numel() > 0]
    if not live or group.size == 1:
        return
    buckets, _ = compute_bucket_assignment_by_size(live, [bucket_bytes])
    is_src = group.global_rank == src
    in_flight: deque[tuple[Any, Any, list[Any]]] = deque()

    async def finish() -> None:
        work, flat, members = in_flight.popleft()
        await work
        if is_src:
            return
        with torch.no_grad():
            offset = 0
            for t in members:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view(t.shape))
                offset += n

    for bucket in buckets:
        members = [live[i] for i in bucket]
        with torch.no_grad():
            if is_src:
                flat = torch.cat([t.detach().reshape(-1) for t in members])
            else:
                flat = torch.empty(sum(t.numel() for t in members), dtype=members[0].dtype)
        if len(in_flight) >= MAX_BROADCASTS_IN_FLIGHT:
            await finish()
        in_flight.append((group.collective("broadcast", flat, src), flat, members))
    while in_flight:
        await finish()


async def exchange_bytes(group: ProcessGroup, payload: bytes, what: str) -> list[bytes]:
    """Every member's ``payload``, in group-rank order; names the ranks that never arrive.

    How it works: each rank sends every other member an 8-byte length, then its payload, and
    waits up to the group's timeout for everyone's length. That one round both exchanges the
    data and tells who is missing: a member whose length has not come by then "did not arrive".

    Raises:
        DistTimeoutError: some members did not take part within the group's timeout; the
            message names them (global ranks).
    """
    wait = group.timeout
    # The group's own deadline is a safety net behind ours, so that ours names the ranks.
    work = group.run_collective("ddp_exchange", lambda ctx: _exchange(ctx, payload, wait, what), wait + 5.0)
    return await work  # type: ignore[no-any-return]


async def _exchange(ctx: OpContext, payload: bytes, wait: float, what: str) -> list[bytes]:
    n, me = ctx.size, ctx.rank
    if n == 1:
        return [payload]
    peers = [p for p in range(n) if p != me]
    heads = {p: bytearray(8) for p in peers}
    head_recvs = {p: ctx.recv(p, memoryview(heads[p])) for p in peers}
    header = memoryview(struct.pack("<q", len(payload)))
    body = memoryview(payload)
    sends = []
    for p in peers:
        sends.append(ctx.send(p, header))
        if payload:
            sends.append(ctx.send(p, body))
    _, pending = await asyncio.wait(list(head_recvs.values()), timeout=wait)
    if pending:
        missing = [ctx.ranks[p] for p, f in head_recvs.items() if f in pending]
        who = name_ranks(missing)
        raise DistTimeoutError(f"{what} on rank {ctx.ranks[me]}: {who} did not arrive within {wait:g} s")
    for f in head_recvs.values():
        f.result()  # a lost peer raises here
    sizes = {p: struct.unpack("<q", heads[p])[0] for p in peers}
    bodies = {p: bytearray(sizes[p]) for p in peers}
    body_recvs = [ctx.recv(p, memoryview(bodies[p])) for p in peers if sizes[p]]
    for f in body_recvs:
        await f
    for s in sends:
        await s
    return [payload if p == me else bytes(bodies[p]) for p in range(n)]
