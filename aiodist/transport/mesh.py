"""Join a job through its store: claim a rank, agree on a job id, connect every peer pair.

The store protocol (all keys under the job's prefix)::

    rank_counter          add() hands out ranks when rank=-1
    world_size            the first arrival's identity (JSON: rank, world size, host, pid, launcher
                          variables); every later rank compares its world size with it
    claim/<rank>          add()ed by whoever takes <rank>; a value above 1 is a duplicate
    claimant/<rank>/<n>   the identity of the n-th process that claimed <rank>
    members               "r0,r1,..." appended by each rank as it joins (names the missing on timeout)
    error                 set by a rank that found the rendezvous broken; everybody raises it
    job                   a random id set by rank 0; part of every peer handshake, so a
                          connection from another job (or an earlier init) is refused
    addr/<rank>           host:port where <rank> accepts peers
    roster                every rank's host id (from the claimants' identities), machine and
                          address (JSON), set by rank 0 once every rank published its address
    local/<rank>          the peers <rank> reaches through shared memory, set once it is connected
    hosts                 whether each rank reaches every other rank of its host through shared
                          memory (JSON), set by rank 0 from the keys above; with the roster, the
                          one host map all ranks use
    hosts/read/<rank>     <rank> has read the host map (rank 0 waits for every one before it returns)

Which prefix an init uses in the store (``namespace``)::

    aiodist/<group>/namespace     the current init's namespace, set by whoever opens it: the
                                  process that just created the store (a random token), else
                                  rank 0 (a count kept in the store); the other ranks read it
    aiodist/<group>/namespaces    rank 0's count, for stores that outlive an init (the user's own)
    aiodist/<group>/arrivals      ranks assigned on arrival count arrivals, world_size per init

Rank r connects to every rank of its host below it and accepts every one above it before init
returns (the ranks of a host agree on shared memory at init); the ranks of other hosts are
connected on first use (``TcpTransport.dial_on_use``), so that a job of many hosts opens the
connections its operations need, not one per pair of ranks. Every wait is bounded by the
rendezvous deadline and watches the ``error`` key, so a broken rendezvous fails everywhere at
once instead of timing out.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from aiodist.errors import DistError, DistStoreError, DistTimeoutError, DistValueError, name_ranks
from aiodist.runtime import host as _host
from aiodist.runtime.progress import every
from aiodist.settings import Settings
from aiodist.store import Store
from aiodist.store.base import StoreShutDownError
from aiodist.transport.base import Transport
from aiodist.transport.shm_tcp import ShmTcpTransport

__all__ = ["Identity", "claim_rank", "connect_mesh", "namespace"]

log = logging.getLogger("aiodist")

_POLL = 0.05
# How long the second claimant of a rank waits for the first one's identity (set right after its claim).
_CLAIMANT_WAIT = 2.0


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a joining process is: what it says about the job, and where it runs."""

    rank: int
    world_size: int
    host: str
    pid: int
    node: int | None = None  # GROUP_RANK (the launcher's node rank)
    local_rank: int | None = None
    local_world_size: int | None = None  # the launcher's processes per node
    host_id: str = ""  # equal for exactly the processes of one host (runtime.host.host_id)
    # Under torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True): this node's restart
    # attempt (TORCHELASTIC_RESTART_COUNT); None elsewhere.
    torchrun_attempt: int | None = None
    machine: str = ""  # equal for the processes of one machine, whatever their hosts (boot id)

    @classmethod
    def here(cls, rank: int, world_size: int, settings: Settings) -> Identity:
        restart = settings.restart_count
        return cls(
            rank,
            world_size,
            socket.gethostname(),
            os.getpid(),
            settings.node_rank,
            settings.local_rank,
            settings.local_world_size,
            _host.host_id(),
            (int(restart) if restart.isdigit() else 0) if settings.agent_store else None,
            _host.machine_id(),
        )

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, raw: bytes) -> Identity | None:
        try:
            fields = json.loads(raw)
            return cls(**fields)
        except (ValueError, TypeError):
            return None

    def where(self) -> str:
        node = "" if self.node is None else f", node {self.node}"
        local = "" if self.local_rank is None else f", local rank {self.local_rank}"
        return f"pid {self.pid} on {self.host}{node}{local}"


def _nodes_disagree(a: Identity, b: Identity) -> str:
    """What two launcher-started processes' variables say went wrong between their nodes ("" if nothing)."""
    if a.torchrun_attempt is not None and a.torchrun_attempt == b.torchrun_attempt and a.rank == b.rank:
        # torchrun's agents assign every rank once per worker group, and each attempt meets in a
        # namespace of its own: the earlier claim is a worker of an earlier group, same attempt.
        return (
            f"; under torchrun that is a worker of an earlier worker group that had the same restart "
            f"attempt ({a.torchrun_attempt}): torchrun's agents count restarts each for itself (one that "
            "stops its healthy workers for another node's restart does not count), so this node is an "
            "attempt behind another. This worker fails so that its agent counts a restart and the next "
            "attempt starts in step (--max-restarts must allow it)"
        )
    if a.node is not None and b.node is not None and a.node > b.node:
        a, b = b, a  # the same words on every rank, whichever of them raises
    if a.node is None or b.node is None or a.local_world_size is None or b.local_world_size is None:
        return ""
    if a.local_world_size != b.local_world_size:
        return (
            f"; the nodes disagree: node {a.node} runs {a.local_world_size} processes per node, "
            f"node {b.node} runs {b.local_world_size} (start every node with the same --nproc-per-node)"
        )
    if a.world_size != b.world_size and a.local_world_size > 0:
        return (
            f"; the nodes disagree on the number of nodes: node {a.node} says "
            f"{a.world_size // a.local_world_size}, node {b.node} says {b.world_size // b.local_world_size} "
            "(start every node with the same --nnodes)"
        )
    if a.node == b.node and a.rank == b.rank:
        hosts = f"{a.host} and {b.host}" if a.host != b.host else f"both on {a.host}"
        return f"; two nodes were started with --node-rank {a.node} ({hosts}): give each node its own"
    return ""


def world_size_disagreement(first: Identity, me: Identity) -> str:
    return (
        f"rendezvous failed: rank {me.rank} says world_size {me.world_size}, rank {first.rank} says "
        f"{first.world_size}{_nodes_disagree(first, me)}"
    )


def duplicate_claim(
    rank: int, first: Identity | None, me: Identity, addr: str | None, completed: bool
) -> str:
    """The message of a second claim of ``rank``; ``completed``: the rendezvous had every rank already."""
    msg = f"rendezvous failed: two processes claim rank {rank}"
    msg += f" (this one is {me.where()})" if first is None else f": {first.where()} and {me.where()}"
    hint = "" if first is None else _nodes_disagree(first, me)
    if not hint and completed:
        where = f" at {addr}" if addr is not None else ""
        hint = (
            f"; the rendezvous{where} had already completed with every rank: another job with the same "
            "group name (and AIODIST_SECRET) uses that address: choose another port, or another group_name"
        )
    return msg + hint


async def _fail(store: Store, msg: str) -> DistValueError:
    """Publish ``msg`` as the rendezvous' error (every waiting rank raises it) and return it."""
    await store.set("error", msg)
    return DistValueError(msg)


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


async def namespace(
    store: Store,
    group_name: str,
    rank: int,
    world_size: int,
    *,
    fresh: bool,
    last: str | None,
    timeout: float,
) -> str:
    """The key prefix of this init in ``store``, the same on every rank of the init.

    ``fresh``: this process created the store for this init. ``last``: the namespace this
    process used the previous time it met this store's address (None: never). A rank that
    is not the opener waits (within ``timeout``) for a namespace other than ``last``: the
    opener may not have arrived yet, or this may be the previous init's store, about to be
    shut down (the wait then ends in ``StoreShutDownError``). Two processes claiming one rank
    read the same namespace, so the claim is caught; a replacement process in its first init
    joins ranks that initialised before.

    Raises:
        DistTimeoutError: rank 0 did not open the init's namespace in time.
    """
    base = f"aiodist/{group_name}"
    if rank == -1:  # ranks assigned on arrival: the n-th world_size arrivals are the n-th init
        return f"{base}/a{(await store.add(f'{base}/arrivals', 1) - 1) // max(world_size, 1) + 1}"
    if fresh or rank == 0:
        name = (
            f"{base}/{secrets.token_hex(6)}"
            if fresh
            else f"{base}/n{await store.add(f'{base}/namespaces', 1)}"
        )
        await store.set(f"{base}/namespace", name)
        return name
    deadline = _Deadline(timeout)
    while True:
        try:
            await store.wait([f"{base}/namespace"], timeout=max(deadline.left(), 0.001))
        except DistTimeoutError:
            raise DistTimeoutError(
                f"rendezvous timed out after {timeout:g} s: missing rank 0 (it opens each init in the store)"
            ) from None
        name = (await store.get(f"{base}/namespace")).decode()
        if name != last:
            return name
        if deadline.left() <= 0:
            raise DistTimeoutError(
                f"rendezvous timed out after {timeout:g} s: missing rank 0 (the store still holds this "
                "process's previous init, and rank 0 did not open a new one)"
            )
        await asyncio.sleep(_POLL)


async def claim_rank(
    store: Store, rank: int, world_size: int, settings: Settings, *, addr: str | None = None
) -> int:
    """Take ``rank`` (or the next free one when -1); fail fast, on every rank, if the job is inconsistent.

    The first arrival records its world size; a later rank that says another one fails the
    rendezvous naming both ("rank 1 says world_size 3, rank 0 says 2"), as does a second claim
    of a rank (naming both processes, and where launcher variables show it, how the nodes
    disagree). ``addr`` (the store's address) only sharpens those messages.

    Raises:
        DistValueError: the disagreement (also published for the other ranks), or a rank out of range.
        DistError: another rank already found the rendezvous broken.
    """
    await _check_error(store)
    auto = rank == -1
    if auto:
        rank = await store.add("rank_counter", 1) - 1
    me = Identity.here(rank, world_size, settings)
    first = Identity.decode(await store.compare_set("world_size", "", me.encode()))
    if first is not None and first.world_size != world_size:
        raise await _fail(store, world_size_disagreement(first, me))
    if auto and rank >= world_size:
        raise await _fail(store, f"rendezvous failed: more than world_size={world_size} processes joined")
    if not 0 <= rank < world_size:
        raise await _fail(
            store, f"rendezvous failed: rank {rank} is out of range for world_size {world_size}"
        )
    holders = await store.add(f"claim/{rank}", 1)
    await store.set(f"claimant/{rank}/{holders}", me.encode())
    if holders > 1:
        earlier: Identity | None = None
        try:
            await store.wait([f"claimant/{rank}/1"], timeout=_CLAIMANT_WAIT)
            earlier = Identity.decode(await store.get(f"claimant/{rank}/1"))
        except DistTimeoutError:
            pass
        seen = _Seen()
        await _check_error(store, seen)
        completed = len(seen.members) >= world_size
        raise await _fail(store, duplicate_claim(rank, earlier, me, addr, completed))
    await store.append("members", f"{rank},")
    log.info("aiodist: rank %d of %d claimed (%s)", rank, world_size, me.where())
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
    settings: Settings,
) -> ShmTcpTransport:
    """Connect this rank to every other rank of the job; returns the ready transport.

    While it waits, a warning every ``AIODIST_RENDEZVOUS_LOG_INTERVAL`` seconds (30) says who
    has joined, who is missing and how long it has waited.
    """
    deadline = _Deadline(timeout)
    seen = _Seen()
    unconnected = set(range(world_size)) - {rank}
    report = _progress_report(rank, world_size, deadline, seen, unconnected)
    async with every(report, settings.rendezvous_log_interval):
        return await _connect_mesh(
            store, rank, world_size, (group_name, secret, host, settings), deadline, seen, unconnected
        )


def _progress_report(
    rank: int, world_size: int, deadline: _Deadline, seen: _Seen, unconnected: set[int]
) -> Callable[[float], None]:
    def report(waited: float) -> None:
        missing = [r for r in range(world_size) if r not in seen.members]
        if missing:
            log.warning(
                "aiodist: rank %d has waited %.0f s for the rendezvous: %d of %d ranks joined, missing %s "
                "(gives up in %.0f s)",
                rank,
                waited,
                world_size - len(missing),
                world_size,
                _ranks(missing),
                deadline.left(),
            )
        else:
            log.warning(
                "aiodist: rank %d has waited %.0f s for the rendezvous: all %d ranks joined, not yet "
                "connected with %s (gives up in %.0f s)",
                rank,
                waited,
                world_size,
                _ranks(sorted(unconnected)),
                deadline.left(),
            )

    return report


def _on_connected(unconnected: set[int], peer: int) -> Callable[[asyncio.Future[None]], None]:
    def done(task: asyncio.Future[None]) -> None:
        if not task.cancelled() and task.exception() is None:
            unconnected.discard(peer)

    return done


def _ranks(ranks: list[int]) -> str:
    return name_ranks(ranks, at_most=20)


async def _connect_mesh(
    store: Store,
    rank: int,
    world_size: int,
    how: tuple[str, bytes | None, str, Settings],  # group name, secret, host to listen on, settings
    deadline: _Deadline,
    seen: _Seen,
    unconnected: set[int],
) -> ShmTcpTransport:
    group_name, secret, host, settings = how
    try:
        mode = settings.checked_host_algos()  # before connecting: a bad value fails every rank at once
    except DistValueError as exc:
        raise await _fail(store, f"rendezvous failed: rank {rank}: {exc}") from None
    if rank == 0:
        await store.set("job", secrets.token_hex(8))
    try:
        await _wait(store, ["job"], deadline, "rank 0 did not arrive", seen)
    except DistTimeoutError:
        raise _missing_error(seen, world_size, deadline) from None
    job = f"{group_name}/{(await store.get('job')).decode()}"
    transport = ShmTcpTransport(rank, world_size, job=job, secret=secret, settings=settings)
    try:
        port = await transport.listen(host)
        await store.set(f"addr/{rank}", f"{host}:{port}")
        tasks: list[asyncio.Future[None]] = []
        try:
            # The store is asked a constant number of times per rank, whatever the world size:
            # the roster in one wait and one read, and one watch for a failure elsewhere (rank 0
            # usually hosts the store on the loop it connects on).
            roster = await _roster(store, rank, world_size, deadline, seen)
            transport.dial_on_use(roster.address)
            local = [p for p in range(world_size) if p != rank and roster.keys[p] == roster.keys[rank]]
            unconnected.intersection_update(local)
            for peer in local:
                if peer < rank:
                    where = roster.address(peer)
                    task = asyncio.ensure_future(transport.connect(peer, *where, max(deadline.left(), 0.001)))
                else:
                    task = asyncio.ensure_future(_accept_higher(transport, peer, deadline))
                task.add_done_callback(_on_connected(unconnected, peer))
                tasks.append(task)
            await _unless_failed_elsewhere(store, asyncio.gather(*tasks), seen)
            # Ranks of one host agree on shared memory before the first operation (bounded).
            await transport.shm_settled()
            log.info(
                "aiodist: rank %d connected with the %d peer(s) of its host in %.2f s (the %d of "
                "other hosts on first use); it listens on %s:%d",
                rank,
                len(local),
                deadline.timeout - deadline.left(),
                world_size - 1 - len(local),
                host,
                port,
            )
            await _agree_hosts(store, transport, roster, deadline, seen, mode)
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
    except StoreShutDownError as exc:
        # Rank 0 had set up this rendezvous in that store: its host gave up on it, and no later
        # store will carry it on (before "job" was seen, the caller may look for a later store).
        transport.abort()
        raise DistStoreError(str(exc)) from exc
    except BaseException:
        transport.abort()
        raise


@dataclass(frozen=True)
class _Roster:
    """Every rank's host key, machine and address, as rank 0 read them (equal on every rank)."""

    keys: tuple[str, ...]
    machines: tuple[str, ...]
    addrs: tuple[tuple[str, int], ...]

    def address(self, peer: int) -> tuple[str, int]:
        return self.addrs[peer]


async def _roster(store: Store, rank: int, world_size: int, deadline: _Deadline, seen: _Seen) -> _Roster:
    """Rank 0 reads every rank's identity and address once all published theirs and publishes
    them as one key; every rank reads that key: two requests per rank, whatever the world size."""
    if rank == 0:
        addr_keys = [f"addr/{r}" for r in range(world_size)]
        await _wait(store, addr_keys, deadline, "not every rank published its address", seen)
        idents = await store.multi_get([f"claimant/{r}/1" for r in range(world_size)])
        addrs = [raw.decode().rpartition(":") for raw in await store.multi_get(addr_keys)]
        # Every rank reads the roster: each name (host id, machine, listening host) is written
        # once and the ranks give its number, so that it grows by a few bytes per rank.
        names: dict[str, int] = {}
        ranks = []
        for r, raw in enumerate(idents):
            ident = Identity.decode(raw)
            # A rank of an older version says no host id: it counts as a host of its own.
            key = ident.host_id if ident is not None and ident.host_id else f"rank:{r}"
            machine = ident.machine if ident is not None else ""
            host, _, port = addrs[r]
            ranks += [names.setdefault(x, len(names)) for x in (key, machine, host)] + [int(port)]
        await store.set("roster", json.dumps({"names": list(names), "ranks": ranks}))
    else:
        await _wait(store, ["roster"], deadline, "rank 0 did not publish the roster", seen)
    return _read_roster(json.loads(await store.get("roster")), world_size)


def _read_roster(raw: Any, world_size: int) -> _Roster:
    try:
        names, ranks = raw["names"], raw["ranks"]
        fields = [ranks[i : i + 4] for i in range(0, len(ranks), 4)]
        roster = _Roster(
            tuple(str(names[f[0]]) for f in fields),
            tuple(str(names[f[1]]) for f in fields),
            tuple((str(names[f[2]]), int(f[3])) for f in fields),
        )
    except (KeyError, IndexError, TypeError, ValueError):
        roster = _Roster((), (), ())
    if len(roster.keys) != world_size:
        raise DistValueError("rendezvous failed: rank 0 published a roster of another job")
    return roster


async def _agree_hosts(
    store: Store, transport: Transport, roster: _Roster, deadline: _Deadline, seen: _Seen, mode: str
) -> None:
    """Set ``transport.host_keys``, ``shm_local`` and ``host_algos``, the same on every rank
    (host-aware collectives choose their algorithms from them, so all ranks must see the same).

    Each rank publishes which peers it reaches through shared memory once its connections are up;
    with its ``mode`` (``AIODIST_HOST_ALGOS``); rank 0 reads those reports and publishes the
    map; the others read that one key: O(world size) store requests in all, whatever the world
    size. Ranks whose ``mode`` differs fail the rendezvous, every rank.
    """
    rank, world_size = transport.rank, transport.world_size
    await store.set(f"local/{rank}", json.dumps({"peers": sorted(transport.local_peers()), "mode": mode}))
    if rank == 0:
        locals_ = [f"local/{r}" for r in range(world_size)]
        await _wait(store, locals_, deadline, "not every rank reported its connections", seen)
        reports = [json.loads(raw) for raw in await store.multi_get(locals_)]
        others = {r: rep.get("mode") for r, rep in enumerate(reports) if rep.get("mode") != mode}
        if others:
            said = ", ".join(f"rank {r} has {m}" for r, m in list(others.items())[:8])
            raise await _fail(
                store,
                f"rendezvous failed: AIODIST_HOST_ALGOS differs between ranks: rank 0 has {mode}, "
                f"{said} (set it alike on every rank)",
            )
        local = [set(rep.get("peers", ())) for rep in reports]
        keys = roster.keys
        shm = [
            all(p in local[r] for p in range(world_size) if p != r and keys[p] == keys[r])
            and any(keys[p] == keys[r] for p in range(world_size) if p != r)
            for r in range(world_size)
        ]
        await store.set("hosts", json.dumps({"shm": shm}))
        # Rank 0 hosts the store in most jobs: it must not return (and maybe finish its job and
        # shut the store down) while a peer has yet to read the map, or that peer's init fails.
        read = [f"hosts/read/{r}" for r in range(1, world_size)]
        await _wait(store, read, deadline, "not every rank read the host map", seen)
    else:
        await _wait(store, ["hosts"], deadline, "rank 0 did not publish the host map", seen)
    agreed = json.loads(await store.get("hosts"))
    if rank != 0:
        await store.set(f"hosts/read/{rank}", "1")
    shm = agreed.get("shm")
    if not isinstance(shm, list) or len(shm) != world_size:
        raise DistValueError("rendezvous failed: rank 0 published a host map of another job")
    transport.host_keys = roster.keys
    transport.shm_local = tuple(bool(x) for x in shm)
    transport.host_algos = mode
    me = _host.machine_id()
    if me:
        # Hosts of one machine share its cores: busy polling and worker threads count them all.
        _host.note_ranks_on_machine(sum(m == me for m in roster.machines))


async def _accept_higher(transport: ShmTcpTransport, peer: int, deadline: _Deadline) -> None:
    try:
        await asyncio.wait_for(asyncio.shield(transport.expect(peer)), max(deadline.left(), 0.001))
    except TimeoutError:
        raise DistTimeoutError(f"rank {peer} did not connect") from None


async def _unless_failed_elsewhere(store: Store, work: asyncio.Future[Any], seen: _Seen) -> None:
    """Await ``work``; raise at once the error another rank reports in the store meanwhile
    (checked every ``4 * _POLL`` seconds, which also keeps ``seen`` current for the reports)."""
    try:
        while True:
            await _check_error(store, seen)
            done, _ = await asyncio.wait([work], timeout=_POLL * 4)
            if done:
                await work
                return
    finally:
        work.cancel()


def _missing_error(seen: _Seen, world_size: int, deadline: _Deadline) -> DistTimeoutError:
    joined = sorted(seen.members)
    missing = [r for r in range(world_size) if r not in seen.members]
    if not missing:
        return DistTimeoutError(
            f"rendezvous timed out after {deadline.timeout:g} s: all {world_size} ranks joined the store, "
            "but not every pair of ranks of one host could connect (firewall, wrong AIODIST_HOST, or a different AIODIST_SECRET)"
        )
    return DistTimeoutError(
        f"rendezvous timed out after {deadline.timeout:g} s: joined {len(joined)} of {world_size}, "
        f"missing rank{'s' if len(missing) != 1 else ''} {', '.join(map(str, missing))}"
    )
