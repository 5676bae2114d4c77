"""Join a job through its store: claim a rank, agree on a job id, connect every peer pair.

The store protocol (all keys under the job's prefix)::

    rank_counter          add() hands out ranks when rank=-1
    claim/<rank>          add()ed by whoever takes <rank>; a value above 1 is a duplicate
    members               "r0,r1,..." appended by each rank as it joins (names the missing on timeout)
    error                 set by a rank that found the rendezvous broken; everybody raises it
    job                   a random id set by rank 0; part of every peer handshake, so a
                          connection from another job (or an earlier init) is refused
    addr/<rank>           host:port where <rank> accepts peers

Rank r connects to every rank below it and accepts every rank above it: one connection
per pair. Every wait is bounded by the rendezvous deadline and watches the ``error`` key,
so a broken rendezvous fails everywhere at once instead of timing out.
"""

from __future__ import annotations

import asyncio
import secrets
import time

from aiodist.errors import DistError, DistStoreError, DistTimeoutError, DistValueError
from aiodist.store import Store
from aiodist.transport.tcp import TcpTransport

__all__ = ["claim_rank", "connect_mesh"]

_POLL = 0.05


class _Deadline:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.end = time.monotonic() + timeout

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())


class _Seen:
    """The members seen in the store, refreshed while waiting (the store may be gone by the
    time a timeout has to name the missing ranks)."""

    def __init__(self) -> None:
        self.members: set[int] = set()


async def _check_error(store: Store, seen: _Seen | None = None) -> None:
    if await store.check(["error"]):
        raise DistError((await store.get("error")).decode(errors="replace"))
    if seen is not None and await store.check(["members"]):
        raw = (await store.get("members")).decode()
        seen.members = {int(x) for x in raw.split(",") if x}


async def _wait(
    store: Store, keys: list[str], deadline: _Deadline, what: str, seen: _Seen | None = None
) -> None:
    """Wait for ``keys`` until the deadline, raising at once if another rank reported an error."""
    while True:
        await _check_error(store, seen)
        try:
            await store.wait(keys, timeout=min(_POLL * 4, max(deadline.left(), 0.001)))
            return
        except DistTimeoutError:
            if deadline.left() <= 0:
                raise DistTimeoutError(f"{what} within {deadline.timeout:g} s") from None


async def claim_rank(store: Store, rank: int, world_size: int) -> int:
    """Take ``rank`` (or the next free one when -1); fail fast if another process holds it."""
    if rank == -1:
        rank = await store.add("rank_counter", 1) - 1
        if rank >= world_size:
            raise DistValueError(f"more than world_size={world_size} processes joined this rendezvous")
    if not 0 <= rank < world_size:
        raise DistValueError(f"rank {rank} is out of range for world_size {world_size}")
    holders = await store.add(f"claim/{rank}", 1)
    if holders > 1:
        msg = f"rendezvous failed: two processes claim rank {rank}"
        await store.set("error", msg)
        raise DistValueError(msg)
    await store.append("members", f"{rank},")
    return rank


async def connect_mesh(
    store: Store,
    rank: int,
    world_size: int,
    *,
    group_name: str,
    secret: bytes | None,
    host: str,
    timeout: float,
) -> TcpTransport:
    """Connect this rank to every other rank of the job; returns the ready transport."""
    deadline = _Deadline(timeout)
    seen = _Seen()
    if rank == 0:
        await store.set("job", secrets.token_hex(8))
    try:
        await _wait(store, ["job"], deadline, "rank 0 did not arrive", seen)
    except DistTimeoutError:
        raise _missing_error(seen, world_size, deadline) from None
    job = f"{group_name}/{(await store.get('job')).decode()}"
    transport = TcpTransport(rank, world_size, job=job, secret=secret)
    try:
        port = await transport.listen(host)
        await store.set(f"addr/{rank}", f"{host}:{port}")
        tasks = [
            asyncio.ensure_future(_connect_lower(store, transport, peer, deadline, seen))
            for peer in range(rank)
        ]
        tasks += [
            asyncio.ensure_future(_accept_higher(store, transport, peer, deadline, seen))
            for peer in range(rank + 1, world_size)
        ]
        try:
            await asyncio.gather(*tasks)
        except DistTimeoutError:
            raise _missing_error(seen, world_size, deadline) from None
        except DistStoreError as exc:
            # The store's host gives up at its own deadline, moments before ours: that is
            # the same timeout, not a store failure.
            if deadline.left() < max(1.0, 0.2 * deadline.timeout):
                raise _missing_error(seen, world_size, deadline) from exc
            raise
        finally:
            for t in tasks:
                t.cancel()
        return transport
    except BaseException:
        transport.abort()
        raise


async def _connect_lower(
    store: Store, transport: TcpTransport, peer: int, deadline: _Deadline, seen: _Seen
) -> None:
    await _wait(store, [f"addr/{peer}"], deadline, f"rank {peer} did not publish its address", seen)
    host, _, port = (await store.get(f"addr/{peer}")).decode().rpartition(":")
    await transport.connect(peer, host, int(port), max(deadline.left(), 0.001))


async def _accept_higher(
    store: Store, transport: TcpTransport, peer: int, deadline: _Deadline, seen: _Seen
) -> None:
    arrived = transport.expect(peer)
    while not arrived.done():
        await _check_error(store, seen)
        try:
            await asyncio.wait_for(asyncio.shield(arrived), min(_POLL * 4, max(deadline.left(), 0.001)))
        except TimeoutError:
            if deadline.left() <= 0:
                raise DistTimeoutError(f"rank {peer} did not connect") from None


def _missing_error(seen: _Seen, world_size: int, deadline: _Deadline) -> DistTimeoutError:
    joined = sorted(seen.members)
    missing = [r for r in range(world_size) if r not in seen.members]
    if not missing:
        return DistTimeoutError(
            f"rendezvous timed out after {deadline.timeout:g} s: all {world_size} ranks joined the store, "
            "but not every pair of ranks could connect (firewall, wrong AIODIST_HOST, or a different AIODIST_SECRET)"
        )
    return DistTimeoutError(
        f"rendezvous timed out after {deadline.timeout:g} s: joined {len(joined)} of {world_size}, "
        f"missing rank{'s' if len(missing) != 1 else ''} {', '.join(map(str, missing))}"
    )
