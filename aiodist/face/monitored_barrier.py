"""``monitored_barrier``: a barrier that names the ranks that did not arrive.

How it works: every member except the group's rank 0 sends rank 0 an empty message and
waits for its answer; rank 0 waits (up to ``timeout``) for every member, then answers each
one that arrived with a fixed-size status (ok, or the failure text, so that they fail with
the same diagnosis instead of waiting for their own timeout). A member whose connection is
lost counts as not arriving at once; with ``wait_all_ranks`` rank 0 still waits for the
others until the deadline, so that the error lists every missing rank. Unlike ``barrier``
it also runs on a broken group: it is the tool for finding out who is gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from aiodist.collectives.context import OpContext
from aiodist.errors import DistNetworkError, DistTimeoutError, DistValueError, name_ranks
from aiodist.face.world import resolve_group
from aiodist.group import ProcessGroup
from aiodist.runtime.timeouts import as_seconds
from aiodist.work import Work

__all__ = ["monitored_barrier"]

_ACK_BYTES = 1024  # status byte + the failure text, zero-padded
_OK, _TIMED_OUT, _LOST = 0, 1, 2
# Extra time a member waits for rank 0's answer beyond the barrier's timeout.
_ANSWER_SLACK = 2.0


async def _member(ctx: OpContext, torch_wording: bool) -> None:
    answer = bytearray(_ACK_BYTES)
    verdict = ctx.recv(0, memoryview(answer))
    if not verdict.done():  # else: rank 0 gave up on us before we arrived (and may be gone)
        await ctx.send(0, memoryview(b""))
    await verdict
    if answer[0] != _OK:
        text = bytes(answer[1:]).rstrip(b"\0").decode(errors="replace")
        cls = DistTimeoutError if answer[0] == _TIMED_OUT else DistNetworkError
        if torch_wording:
            raise cls(
                f"Rank {ctx.ranks[ctx.rank]} successfully reached monitoredBarrier, but received errors "
                f"while waiting for send/recv from rank {ctx.ranks[0]}: {text}"
            )
        raise cls(f"monitored_barrier failed (reported by rank {ctx.ranks[0]}): {text}")


def _failed_text(ranks: list[int], ms: int, torch_wording: bool) -> str:
    """aiodist's "ranks 1, 2 failed to pass monitored_barrier in 3000 ms", or torch's
    "Ranks 1, 2 failed to pass monitoredBarrier in 3000 ms" (what torch programs match)."""
    if torch_wording:
        listed = ("Ranks " if len(ranks) > 1 else "Rank ") + ", ".join(map(str, ranks))
        return f"{listed} failed to pass monitoredBarrier in {ms} ms"
    return f"{name_ranks(ranks)} failed to pass monitored_barrier in {ms} ms"


async def _monitor(ctx: OpContext, timeout: float, wait_all_ranks: bool, torch_wording: bool) -> None:
    loop = ctx.loop
    deadline = loop.time() + timeout
    waits: dict[asyncio.Future[int], int] = {
        ctx.recv(p, memoryview(bytearray(0))): p for p in range(1, ctx.size)
    }
    pending = set(waits)
    arrived: list[int] = []
    lost: dict[int, BaseException] = {}
    while pending:
        left = deadline - loop.time()
        if left <= 0:
            break
        done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        for fut in done:
            exc = fut.exception()
            if exc is None:
                arrived.append(waits[fut])
            else:
                lost[waits[fut]] = exc
        if lost and not wait_all_ranks:
            break
    for fut in pending:
        ctx.transport.cancel_recv(fut)
    absent = sorted(waits[f] for f in pending)
    if not wait_all_ranks:
        # Fail at the first problem: the lost members, or else (as torch) the first rank that
        # did not arrive; members still on their way were not given their full time.
        absent = [] if lost else absent[:1]
    failed = sorted([*absent, *lost])
    if not failed:
        await asyncio.gather(*(_answer(ctx, p, _OK, "") for p in arrived))
        return
    ms = round(timeout * 1000)
    text = _failed_text([ctx.ranks[p] for p in failed], ms, torch_wording)
    if lost:
        text += " (" + "; ".join(f"rank {ctx.ranks[p]}: {exc}" for p, exc in sorted(lost.items())) + ")"
    # Every live member gets the verdict (one that has not arrived yet finds it when it does).
    live = [p for p in range(1, ctx.size) if p not in lost]
    status = _TIMED_OUT if absent else _LOST
    await asyncio.gather(*(_answer(ctx, p, status, text) for p in live), return_exceptions=True)
    if absent:
        raise DistTimeoutError(text)
    raise DistNetworkError(text)


async def _answer(ctx: OpContext, peer: int, status: int, text: str) -> None:
    buf = bytearray(_ACK_BYTES)
    buf[0] = status
    raw = text.encode()[: _ACK_BYTES - 1]
    buf[1 : 1 + len(raw)] = raw
    await ctx.send(peer, memoryview(buf))


def monitored_barrier(
    group: Any = None, timeout: Any = None, wait_all_ranks: bool = False, *, torch_wording: bool = False
) -> Work:
    """A barrier whose group rank 0 names the members that did not arrive within ``timeout``.

    Args:
        group: the group (None: the default group).
        timeout: seconds or ``timedelta`` (None: the group's timeout).
        wait_all_ranks: rank 0 waits for every member until the deadline and names all that
            are missing; otherwise it fails at the first one (a lost member at once).
        torch_wording: word the errors as torch does ("Rank 1 failed to pass monitoredBarrier
            in 3000 ms"; the others "Rank 2 successfully reached monitoredBarrier, but received
            errors while waiting for send/recv from rank 0: ..."), for the blocking face.
    Returns:
        A Work completing once every member has passed.
    Raises:
        (from the Work) ``DistTimeoutError`` on rank 0, e.g. "ranks 1, 2 failed to pass
        monitored_barrier in 3000 ms" (``DistNetworkError`` when every missing member was
        lost); the same error and text on the other members. Runs on a broken group too.
    """
    g: ProcessGroup = resolve_group(group)
    t = g.timeout if timeout is None else as_seconds(timeout)
    if t <= 0:
        raise DistValueError(f"monitored_barrier timeout must be positive, got {t}")

    def algorithm(ctx: OpContext) -> Coroutine[Any, Any, None]:
        if ctx.rank == 0:
            return _monitor(ctx, t, wait_all_ranks, torch_wording)
        return _member(ctx, torch_wording)

    # Rank 0 answers within the timeout; a member waits for the answer a little longer.
    slack = 2 * _ANSWER_SLACK if g.rank == 0 else _ANSWER_SLACK
    return g.run_collective("monitored_barrier", algorithm, t + slack, allow_broken=True, survives_loss=True)
