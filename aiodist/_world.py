"""The default process group of this process, and the calls that create and destroy groups.

This is the one piece of module-level state of the runtime (torch's default group, which
both faces share); every other object is passed explicitly.
"""

from __future__ import annotations

import asyncio
import atexit
import datetime
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from aiodist import _loop_thread
from aiodist.errors import DistError, DistTimeoutError, DistTypeError, DistValueError
from aiodist.group import ProcessGroup
from aiodist.rendezvous import is_loopback, local_address_towards, resolve_rendezvous
from aiodist.store import PrefixStore, Store
from aiodist.transport.base import Transport
from aiodist.transport.mesh import claim_rank, connect_mesh
from aiodist.wire.handshake import secret_from_env

__all__ = [
    "destroy_process_group",
    "get_backend",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_initialized",
    "new_group",
    "resolve_group",
    "world",
    "WORLD",
]

log = logging.getLogger("aiodist")

BACKENDS = {"tcp": "tcp", "gloo": "tcp", "nccl": "nccl"}


@dataclass
class World:
    """Everything ``init_process_group`` built, torn down by ``destroy_process_group``."""

    default_group: ProcessGroup
    transport: Transport
    store: Store
    owns_store: bool
    backend: str
    loop: asyncio.AbstractEventLoop
    groups: list[ProcessGroup] = field(default_factory=list)
    next_gid: int = 1


_world: World | None = None
_generation = 0  # how many times this process has initialised; keys each init's store use apart
_warned_insecure = False


def world() -> World:
    if _world is None:
        raise DistValueError(
            "Default process group has not been initialized, please make sure to call init_process_group."
        )
    return _world


def _seconds(timeout: Any) -> float:
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    if isinstance(timeout, int | float) and not isinstance(timeout, bool):
        return float(timeout)
    raise DistTypeError(f"timeout must be seconds or a datetime.timedelta, not {type(timeout).__name__}")


async def init_process_group(
    backend: str | None = "tcp",
    init_method: str | None = None,
    *,
    rank: int = -1,
    world_size: int = -1,
    timeout: float | datetime.timedelta = 1800.0,
    store: Store | None = None,
    group_name: str = "default",
    device_id: Any = None,
) -> None:
    """Join the job: rendezvous, connect every peer, create the default group.

    Args:
        backend: "tcp" (default; "gloo" is an alias) or "nccl".
        init_method: None / "env://", "tcp://host:port", "tcp://<multicast group>:port", "file:///path".
        rank: this process's rank; -1 takes it from the environment or assigns one.
        world_size: number of processes; -1 takes it from the environment.
        timeout: bounds the rendezvous and, later, every operation of the default group.
        store: a store to rendezvous through instead of ``init_method``.
        group_name: keeps jobs that share an address or a file apart.
        device_id: accepted for torch compatibility (CUDA device of this rank).
    Raises:
        DistTimeoutError: a rank did not arrive in time (the message names the missing ranks).
        DistValueError: bad arguments, a duplicate rank, or the group is already initialised.
    """
    global _world, _generation, _warned_insecure
    if _world is not None:
        raise DistValueError("trying to initialize the default process group twice")
    name = (backend or "tcp").lower()
    if name not in BACKENDS:
        raise DistValueError(f"unknown backend {backend!r} (use 'tcp', 'gloo' or 'nccl')")
    if BACKENDS[name] == "nccl":
        raise DistValueError(
            "backend 'nccl' needs CUDA and torch's NCCL engine, which this build does not provide"
        )
    seconds = _seconds(timeout)
    loop = asyncio.get_running_loop()
    rdv = await resolve_rendezvous(
        init_method, rank=rank, world_size=world_size, timeout=seconds, store=store
    )
    _generation += 1
    job_store: Store = PrefixStore(f"aiodist/{group_name}/{_generation}", rdv.store)
    secret = secret_from_env()
    try:
        my_rank = await claim_rank(job_store, rdv.rank, rdv.world_size)
        host = local_address_towards(rdv.master_addr or "127.0.0.1")
        if secret is None and not is_loopback(host) and not _warned_insecure:
            _warned_insecure = True
            log.warning(
                "aiodist: no AIODIST_SECRET set and peers listen on %s: anyone who reaches it can join", host
            )
        transport = await connect_mesh(
            job_store,
            my_rank,
            rdv.world_size,
            group_name=group_name,
            secret=secret,
            host=host,
            timeout=seconds,
        )
    except BaseException as exc:
        if rdv.owns_store:
            if isinstance(exc, DistError) and not isinstance(exc, DistTimeoutError):
                # We may host the store: keep it up a moment so the other ranks can read why
                # the rendezvous failed instead of finding the store gone.
                await asyncio.sleep(min(1.0, seconds))
            await rdv.store.aclose()
        raise
    group = ProcessGroup(
        transport, range(rdv.world_size), 0, timeout=seconds, backend="tcp", name="default group"
    )
    _world = World(group, transport, rdv.store, rdv.owns_store, "tcp", loop, [group])
    _leave_at_exit(loop)
    log.debug("aiodist: rank %d of %d initialised (pid %d)", my_rank, rdv.world_size, os.getpid())


_exit_hook_registered = False


def _leave_at_exit(loop: asyncio.AbstractEventLoop) -> None:
    """When the runtime runs on the sync face's loop thread, leave in order at interpreter exit.

    torch scripts often end without ``destroy_process_group``; an orderly leave tells the
    peers this rank is done (not crashed), so ranks still talking among themselves go on.
    """
    global _exit_hook_registered
    lt = _loop_thread._instance
    if _exit_hook_registered or lt is None or lt.loop is not loop:
        return
    _exit_hook_registered = True
    # atexit runs last-registered first: this runs before the loop thread is stopped.
    atexit.register(_destroy_at_exit, lt)


def _destroy_at_exit(lt: _loop_thread.LoopThread) -> None:
    if _world is None or _world.loop is not lt.loop or lt.loop.is_closed():
        return
    try:
        lt.run(destroy_process_group(), timeout=10)
    except Exception as exc:  # exiting anyway; say why the leave was not clean
        log.debug("aiodist: destroy_process_group at exit failed: %s", exc)


async def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Destroy ``group``, or with None everything: every group, every connection, the store.

    In-flight operations fail with ``DistError``; afterwards the process may init again.
    """
    global _world
    w = _world
    if w is None:
        return
    if group is not None and group is not w.default_group:
        group.abort("the process group was destroyed")
        if group in w.groups:
            w.groups.remove(group)
        return
    _world = None
    for g in w.groups:
        g.abort("the process group was destroyed")
    await w.transport.aclose()
    if w.owns_store:
        await w.store.aclose()


def is_initialized() -> bool:
    return _world is not None


def resolve_group(group: Any) -> ProcessGroup:
    """The group an operation runs on: ``group`` itself, or the default group for None / WORLD."""
    if group is None or group is _WORLD_SENTINEL:
        return world().default_group
    if isinstance(group, ProcessGroup):
        return group
    raise DistTypeError(f"group must be a ProcessGroup or None, not {type(group).__name__}")


class _WorldSentinel:
    """``group.WORLD``: stands for the default group, whichever it is when an operation runs."""

    def __repr__(self) -> str:
        return "group.WORLD"


WORLD: Any = _WorldSentinel()
_WORLD_SENTINEL = WORLD


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (-1 if it is not a member)."""
    return resolve_group(group).rank


def get_world_size(group: Any = None) -> int:
    return resolve_group(group).size


def get_backend(group: Any = None) -> str:
    return resolve_group(group).backend


async def new_group(
    ranks: Any = None, timeout: float | datetime.timedelta | None = None, backend: str | None = None, **_: Any
) -> ProcessGroup:
    """Create a group of ``ranks`` (global ranks; None = all). Every rank of the job calls it, in order.

    Non-members get a handle whose ``rank`` is -1; operations on it raise.
    """
    w = world()
    size = w.default_group.size
    members = list(range(size)) if ranks is None else sorted(int(r) for r in ranks)
    for r in members:
        if not 0 <= r < size:
            raise DistValueError(f"new_group: rank {r} is not in the world of size {size}")
    if len(set(members)) != len(members):
        raise DistValueError(f"new_group: ranks {members} contain duplicates")
    gid = w.next_gid
    w.next_gid += 1
    t = w.default_group.timeout if timeout is None else _seconds(timeout)
    group = ProcessGroup(w.transport, members, gid, timeout=t, backend=w.backend)
    w.groups.append(group)
    return group
