"""``AIODIST_DEBUG=DETAIL``: an explicit all-rank agreement check before each collective.

How it works: before the algorithm runs, every rank sends its operation's fingerprint
(op, sequence number, dtype, count, root, reduce op, origin) to every other member of the group,
on the group's control channel under the operation's sequence number (so the check never
mixes with data, and a check of one operation never with another's), and waits for
everyone's. Every rank then holds the same table, so all of them reach the same verdict:
ranks that disagree give a ``CollectiveMismatchError`` on every rank listing each rank's
call; a rank that never arrives gives a ``DistTimeoutError`` naming it, shortly before the
operation's own timeout. n(n-1) messages of ``SLOT`` bytes (their format:
``aiodist.wire.detail``): a debugging aid, not free.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiodist.collectives.context import OpContext
from aiodist.errors import CollectiveMismatchError, DistTimeoutError, name_ranks
from aiodist.runtime.origin import OriginBook
from aiodist.transport.base import CTRL, describe_fingerprint
from aiodist.wire.detail import SLOT, decode_slot, encode_slot
from aiodist.wire.fingerprint import ORDER_HINT, Fingerprint, describe_all
from aiodist.wire.frames import ProtocolError

__all__ = ["check_fingerprints"]


def _read(slot: bytearray) -> Fingerprint:
    try:
        return decode_slot(slot)
    except ProtocolError:  # a peer of another version: show what it sent rather than crash
        return ["<undecodable fingerprint>"]


def _agree(
    table: dict[int, Fingerprint], seen: dict[int, list[int]], me: int, book: OriginBook | None
) -> bool:
    """Every member called the same collective: equal fingerprints, or fingerprints that differ
    only in origins the group's book finds no race in (``OriginBook.clash_in``)."""
    mine = table[me]
    if all(fp == mine for fp in table.values()):
        return True
    if book is None or any(len(fp) != 7 or fp[:6] != mine[:6] for fp in table.values()):
        return False
    return not book.clash_in({g: (str(fp[6]), seen[g]) for g, fp in table.items()}, me)


async def check_fingerprints(
    ctx: OpContext, timeout: float | None, coro: Any = None, what: str = "DETAIL check"
) -> None:
    """Exchange fingerprints with every member; raise unless all equal ours.

    ``coro`` (the algorithm, not started yet) is closed when the check fails; ``what`` names
    the check in its errors.

    Raises:
        CollectiveMismatchError: some rank called something else (the message lists all).
        DistTimeoutError: some ranks did not reach this operation within ``timeout``.
    """
    try:
        await _check(ctx, timeout, what)
    except BaseException:
        if coro is not None:
            coro.close()
        raise


async def _check(ctx: OpContext, timeout: float | None, what: str) -> None:
    n, r = ctx.size, ctx.rank
    if n == 1:
        return
    key = (ctx.key[0], CTRL, ctx.key[2])
    transport = ctx.transport
    book = transport.mailbox.origin_books.get(ctx.key[0])
    # (with the origins the group has seen here: every member then judges origins alike)
    mine = encode_slot([*(ctx.fp or []), book.hashes() if book is not None else []])
    bufs = {p: bytearray(SLOT) for p in range(n) if p != r}
    recvs = {p: transport.recv(ctx.ranks[p], key, memoryview(b)) for p, b in bufs.items()}
    sends = [transport.send(ctx.ranks[p], key, mine) for p in bufs]
    try:
        _, pending = await asyncio.wait(list(recvs.values()), timeout=timeout)
    except BaseException:
        transport.abandon(key)
        raise
    name = describe_fingerprint(ctx.fp)
    if pending:
        transport.abandon(key)
        missing = sorted(ctx.ranks[p] for p, f in recvs.items() if f in pending)
        who = name_ranks(missing)
        raise DistTimeoutError(
            f"{what} of {name} on rank {ctx.ranks[r]}: {who} did not reach this collective "
            f"within {timeout:g} s"
        )
    for f in recvs.values():
        f.result()  # a lost peer raises here
    for s in sends:
        await s
    table = {ctx.ranks[r]: list(ctx.fp or [])}
    seen: dict[int, list[int]] = {ctx.ranks[r]: book.hashes() if book is not None else []}
    for p, b in bufs.items():
        slot = _read(b)
        table[ctx.ranks[p]] = slot[:7]
        hashes = slot[7] if len(slot) > 7 and isinstance(slot[7], list) else []
        seen[ctx.ranks[p]] = [h for h in hashes if isinstance(h, int)]
    if _agree(table, seen, ctx.ranks[r], book):
        return
    ranks = sorted(table)
    texts, only_origin = describe_all([table[g] for g in ranks])
    groups: dict[str, list[int]] = {}
    for g, text in zip(ranks, texts, strict=True):
        groups.setdefault(text, []).append(g)
    lines = "; ".join(
        f"{'rank' if len(rs) == 1 else 'ranks'} {', '.join(map(str, rs))}: {text}"
        for text, rs in groups.items()
    )
    hint = f"; {ORDER_HINT}" if only_origin else ""
    raise CollectiveMismatchError(
        f"{what} on rank {ctx.ranks[r]}: ranks called different collectives: {lines}{hint}"
    )
