"""The default process group of this process, and the calls that create and destroy groups.

This is the one piece of module-level state of the runtime (torch's default group, which
both faces share); every other object is passed explicitly.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import zlib
from dataclasses import dataclass, field
from typing import Any

from aiodist.backends import torch_engine as _engine
from aiodist.backends.base import Backend
from aiodist.backends.native import NATIVE
from aiodist.backends.staged import CudaStager, StagedBackend, Stager
from aiodist.errors import DistError, DistTimeoutError, DistTypeError, DistValueError
from aiodist.group import ProcessGroup
from aiodist.job import Job
from aiodist.rendezvous import (
    Rendezvous,
    is_loopback,
    job_namespace,
    local_address_towards,
    resolve_rendezvous,
    while_current,
)
from aiodist.runtime import busy_poll as _busy_poll
from aiodist.runtime import loop_thread as _loop_thread
from aiodist.runtime import origin as _origin
from aiodist.runtime.timeouts import as_seconds
from aiodist.settings import Settings
from aiodist.store import PrefixStore, Store, TCPStore
from aiodist.store.base import StoreShutDownError
from aiodist.transport.base import Transport, exit_goodbye
from aiodist.wire.control import Goodbye

__all__ = [
    "destroy_process_group",
    "get_backend",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_initialized",
    "new_group",
    "resolve_group",
    "set_stager",
    "world",
    "WORLD",
]

log = logging.getLogger("aiodist")

# Backend names -> what runs them: aiodist's own transport ("tcp", which stages CUDA tensors
# through host memory), or a torch engine behind aiodist's API (aiodist.backends.torch_engine).
BACKENDS = {"tcp": "tcp", "gloo": "tcp", "nccl": "nccl", "torch-gloo": "torch-gloo"}


@dataclass
class World:
    """The faces' view of the job ``init_process_group`` joined: its default group and the
    groups made since, torn down (with the job) by ``destroy_process_group``."""

    default_group: ProcessGroup
    job: Job
    store: Store  # the rendezvous store (the job closes it where this process created it)
    backend: str
    loop: asyncio.AbstractEventLoop
    groups: list[ProcessGroup] = field(default_factory=list)
    # The backend of the groups on aiodist's transport: CUDA tensors staged through host
    # memory by its stager (closed by destroy).
    staged: StagedBackend = field(default_factory=lambda: StagedBackend(NATIVE, CudaStager()))
    engine: str | None = None  # "nccl" / "torch-gloo": the torch engine of every group
    job_store: Store | None = None  # this init's store namespace (engines rendezvous under it)
    host: str = "127.0.0.1"  # the address peers reach this rank at
    device: Any = None  # device_id, as a torch.device
    # On a program's own loop: the task that leaves the job in order when asyncio.run winds
    # the loop up (see _leave_when_the_loop_ends).
    guardian: asyncio.Task[None] | None = None

    @property
    def transport(self) -> Transport:
        return self.job.transport

    @property
    def settings(self) -> Settings:
        """What the environment said when the job started (read once, by ``init_process_group``)."""
        return self.job.settings

    async def close_groups(self, reason: str) -> None:
        """The world's part of closing its job: fail what is in flight, free what the groups
        ran on (their torch engines, the staging pool)."""
        global _world
        if _world is self:
            _world = None
        if self.guardian is not None and self.guardian is not asyncio.current_task():
            self.guardian.cancel()
        for g in self.groups:
            g.abort(reason)
        for g in self.groups:
            if g.runs_on is not self.staged:
                await g.runs_on.aclose()
        await self.staged.aclose()


_world: World | None = None
_warned_insecure = False


def world() -> World:
    if _world is None:
        raise DistValueError(
            "Default process group has not been initialized, please make sure to call init_process_group."
        )
    return _world


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
        backend: "tcp" (default; "gloo" is an alias: aiodist's transport, which stages CUDA
            tensors through host memory), "nccl" (torch's NCCL engine) or "torch-gloo" (torch's
            gloo engine); see docs/torch.md, "CUDA tensors and NCCL".
        init_method: None / "env://", "tcp://host:port", "tcp://<multicast group>:port", "file:///path".
        rank: this process's rank; -1 takes it from the environment or assigns one.
        world_size: number of processes; -1 takes it from the environment.
        timeout: bounds the rendezvous and, later, every operation of the default group.
        store: a store to rendezvous through instead of ``init_method``.
        group_name: keeps jobs that share an address or a file apart.
        device_id: the CUDA device of this rank (an int, "cuda:N" or ``torch.device``): made
            current on the runtime loop's thread, and with "nccl" the engine's communicator is
            connected on it at once. Without it, "nccl" uses ``LOCAL_RANK``'s device (as set by
            ``aiodist-run``/torchrun), else the current one.
    Raises:
        DistTimeoutError: a rank did not arrive in time (the message names the missing ranks).
        DistValueError: bad arguments, a duplicate rank, or the group is already initialised.
    """
    # Every variable is read here, once: a bad value fails before any rendezvous.
    await init_job(
        Settings.read(),
        backend,
        init_method,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        store=store,
        group_name=group_name,
        device_id=device_id,
    )


async def init_job(
    settings: Settings,
    backend: str | None,
    init_method: str | None,
    *,
    rank: int,
    world_size: int,
    timeout: float | datetime.timedelta,
    store: Store | None,
    group_name: str,
    device_id: Any,
) -> None:
    """``init_process_group`` with the ``settings`` the caller read (the sync face reads them
    once for its own part of the init too)."""
    global _world
    if _world is not None:
        raise DistValueError("trying to initialize the default process group twice")
    name = (backend or "tcp").lower()
    if name not in BACKENDS:
        raise DistValueError(f"unknown backend {backend!r} (use 'tcp', 'gloo', 'nccl' or 'torch-gloo')")
    engine = None if BACKENDS[name] == "tcp" else BACKENDS[name]
    if engine is not None:
        _engine.check_available(engine)
    settings.apply()
    device = _device(device_id, engine, settings)
    seconds = as_seconds(timeout)
    loop = asyncio.get_running_loop()
    _origin.install(loop)  # collectives carry the name of the task that started them
    _busy_poll.for_loop(loop)
    deadline = loop.time() + seconds
    left = seconds
    while True:
        rdv = await resolve_rendezvous(
            init_method, rank=rank, world_size=world_size, timeout=left, store=store, settings=settings
        )
        try:
            job_store, (host, job) = await while_current(
                rdv, _meet(rdv, group_name, settings.secret or rdv.secret, left, settings)
            )
            if rdv.owns_store:
                rdv.store.set_timeout(seconds)  # later store calls get the job's timeout, not what was left
                job.store = rdv.store
            break
        except StoreShutDownError as exc:
            # We reached a store whose host was shutting it down (a previous init's store, at
            # the same address): look for the next one at that address, within the timeout.
            if not rdv.owns_store:
                raise
            await rdv.store.aclose()
            if deadline - loop.time() < max(1.0, 0.2 * seconds):
                raise
            log.info("aiodist: %s; joining the rendezvous again", exc)
            left = max(deadline - loop.time(), 0.001)
        except BaseException as exc:
            if rdv.owns_store:
                if isinstance(exc, DistError) and not isinstance(exc, DistTimeoutError):
                    # We may host the store: keep it up a moment so the other ranks can read why
                    # the rendezvous failed instead of finding the store gone.
                    await asyncio.sleep(min(1.0, seconds))
                await rdv.store.aclose()
            raise
    # The rendezvous told how many ranks share this machine's cores (other hosts of it too).
    _busy_poll.for_loop(loop).reconsider()
    label = engine or "tcp"
    try:  # (whatever fails from here leaves nothing open: the job closes what it holds)
        # (A CudaStager touches nothing of CUDA until a CUDA tensor is staged.)
        staged = StagedBackend(NATIVE, CudaStager())
        runs_on = _backend_for(engine, staged, job_store, 0, host, device)
        group = ProcessGroup(
            job.transport,
            range(rdv.world_size),
            0,
            timeout=seconds,
            backend=label,
            name="default group",
            runs_on=runs_on,
            task_check=settings.task_check,
        )
        w = World(group, job, rdv.store, label, loop, [group], staged=staged)
        w.engine, w.job_store, w.host, w.device = engine, job_store, host, device
        job.on_close(w.close_groups)
        await _connect(group)
    except BaseException:
        await job.close("init_process_group failed")
        raise
    _world = w
    _leave_when_the_loop_ends(w)
    log.debug("aiodist: rank %d of %d initialised (pid %d)", job.rank, rdv.world_size, os.getpid())


async def _meet(
    rdv: Rendezvous, group_name: str, secret: bytes | None, timeout: float, settings: Settings
) -> tuple[Store, tuple[str, Job]]:
    """This init's namespace in the rendezvous store, and ``_join``'s (host, job)."""
    job_store = await job_namespace(rdv, group_name, timeout)
    return job_store, await _join(rdv, job_store, group_name, secret, timeout, settings)


async def _join(
    rdv: Rendezvous,
    job_store: Store,
    group_name: str,
    secret: bytes | None,
    timeout: float,
    settings: Settings,
) -> tuple[str, Job]:
    """Join the job in ``job_store``: (the address peers reach this rank at, the job)."""
    global _warned_insecure
    st = rdv.store
    addr = f"{st.host}:{st.port}" if isinstance(st, TCPStore) else None
    # (A bad AIODIST_HOST fails before the claim.)
    host = local_address_towards(rdv.master_addr or "127.0.0.1", settings)
    if secret is None and not is_loopback(host) and not _warned_insecure:
        _warned_insecure = True
        log.warning(
            "aiodist: no AIODIST_SECRET set and peers listen on %s: anyone who reaches it can join", host
        )
    job = await Job.join(
        job_store,
        rdv.rank,
        rdv.world_size,
        group_name=group_name,
        secret=secret,
        host=host,
        timeout=timeout,
        settings=settings,
        addr=addr,
    )
    return host, job


def _device(device_id: Any, engine: str | None, settings: Settings) -> Any:
    """The CUDA device of this rank (``device_id``; for "nccl" also LOCAL_RANK's), made current."""
    if device_id is None and engine == "nccl":
        local = settings.local_rank
        device_id = local if local is not None and local >= 0 else None
        if device_id is None:
            import torch

            device_id = torch.cuda.current_device()
    if device_id is None or str(device_id) == "cpu":
        return None
    device = _engine.cuda_device(device_id)
    import torch

    torch.cuda.set_device(device)  # the runtime loop's thread enqueues this rank's device work
    return device


def _backend_for(
    engine: str | None, staged: StagedBackend, job_store: Store, gid: int, host: str, device: Any
) -> Backend:
    """What a new group runs on: the job's staged native backend, or a torch engine of its own."""
    if engine is None:
        return staged
    return _engine.TorchBackend(engine, PrefixStore(f"engine/{gid}/", job_store), host=host, device=device)


async def _connect(group: ProcessGroup) -> None:
    """Connect a member's torch engine (every member of the group calls it at about one time)."""
    if isinstance(group.runs_on, _engine.TorchBackend) and group.rank >= 0:
        await group.runs_on.connect(group)


def set_stager(stager: Stager | None) -> Stager | None:
    """Replace the stager of this job's groups on aiodist's transport (present and future).

    For tests: ``set_stager(HostStager())`` stages every CPU tensor through host buffers, to
    run the staging path where there is no GPU. The job owns the new stager: it is closed by
    ``destroy_process_group``. Returns the old one (no longer closed by the job).
    """
    w = world()
    old, w.staged.stager = w.staged.stager, stager
    return old


def _leave_when_the_loop_ends(w: World) -> None:
    """On a program's own loop (the async face), leave in order when the program ends.

    ``asyncio.run`` (and ``uvloop.run``) cancel every task still pending once the main
    coroutine has returned or raised, and run the loop until they are done: a task waiting
    here is then told, and says goodbye to the peers (how the program ended: its main task's
    exception, if it raised) before the loop closes. Without it, a program ending without
    ``destroy_process_group`` would look to its peers like a crash, and what it sent last
    could be refused to them.
    """
    lt = _loop_thread.started_loop_thread()
    if lt is not None and lt.loop is w.loop:
        return  # the sync face's loop thread: the job's exit hook leaves (aiodist.job)
    w.guardian = w.loop.create_task(_guard(w, asyncio.current_task()))


async def _guard(w: World, main: asyncio.Task[Any] | None) -> None:
    try:
        await w.loop.create_future()  # (set by nobody: destroy_process_group cancels it)
    except asyncio.CancelledError:
        if _world is not w:
            return  # destroyed: nothing to do
        w.transport.goodbye = _ending_of(main)
        try:
            await destroy_process_group()
        except Exception as exc:  # the loop is winding up anyway; say why the leave was not clean
            log.debug("aiodist: destroy_process_group as the loop ended failed: %s", exc)


def _ending_of(main: asyncio.Task[Any] | None) -> Goodbye:
    """How the program whose main task is ``main`` ended, for its goodbye."""
    if main is None or not main.done():
        return exit_goodbye()
    if main.cancelled():
        return Goodbye("exception", "KeyboardInterrupt or cancellation of the main task")
    exc = main.exception()
    if isinstance(exc, SystemExit) and exc.code not in (None, 0):
        return Goodbye("exit_code", str(exc.code))
    if exc is None or isinstance(exc, SystemExit):
        return Goodbye("exit")
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return Goodbye("exception", text[:500])


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
        if group.runs_on is not w.staged:
            await group.runs_on.aclose()
        if group in w.groups:
            w.groups.remove(group)
        return
    _world = None
    await w.job.close("the process group was destroyed")


def is_initialized() -> bool:
    """True between ``init_process_group`` and ``destroy_process_group`` (of the world)."""
    return _world is not None


def resolve_group(group: Any) -> ProcessGroup:
    """The group an operation runs on: ``group`` itself, or the default group for None / WORLD."""
    if group is None or group is WORLD:
        return world().default_group
    if isinstance(group, ProcessGroup):
        return group
    inner = _aiodist_group_of(group)
    if inner is not None:
        return inner
    raise DistTypeError(f"group must be a ProcessGroup or None, not {type(group).__name__}")


def _aiodist_group_of(group: Any) -> ProcessGroup | None:
    """The aiodist group under a group torch made on the backend "aiodist" in this job (torch's
    new_group in a program that uses ``aiodist.sync``): the backend's group object itself, or
    torch's ProcessGroup around it (found by its torch name)."""
    inner = getattr(group, "aiodist_group", None)
    if isinstance(inner, ProcessGroup):
        return inner
    name = getattr(group, "group_name", None)
    if _world is None or not isinstance(name, str):
        return None
    return _world.transport.torch_groups.get(name)


class _WorldSentinel:
    """``group.WORLD``: stands for the default group, whichever it is when an operation runs."""

    def __repr__(self) -> str:
        return "group.WORLD"


WORLD: Any = _WorldSentinel()


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (-1 if it is not a member)."""
    return resolve_group(group).rank


def get_world_size(group: Any = None) -> int:
    """The number of members of ``group`` (default: the world).

    Raises:
        DistValueError: not initialised; DistTypeError: ``group`` is not a ProcessGroup.
    """
    return resolve_group(group).size


def get_backend(group: Any = None) -> str:
    """The backend name ``group`` (default: the world) runs on: "tcp", "nccl" or "torch-gloo".

    Raises:
        DistValueError: not initialised; DistTypeError: ``group`` is not a ProcessGroup.
    """
    return resolve_group(group).backend


async def new_group(
    ranks: Any = None,
    timeout: float | datetime.timedelta | None = None,
    backend: str | None = None,
    *,
    sort_ranks: bool = True,
    use_local_synchronization: bool = False,
    task_check: str | None = None,
    **_: Any,
) -> ProcessGroup:
    """Create a group of ``ranks`` (global ranks; None = all). Every rank of the job calls it, in order.

    Non-members get a handle whose ``rank`` is -1; operations on it raise. ``backend`` (default:
    the job's) picks what runs the group's tensor operations: "tcp"/"gloo" aiodist's transport,
    "nccl"/"torch-gloo" a torch engine of its own (e.g. a "gloo" group for CPU tensors in an
    "nccl" job, as in torch).

    Args:
        sort_ranks: as torch: True (default) sorts ``ranks``; False keeps the given order, so
            that position in ``ranks`` is the group rank (every rank must pass the same list).
        use_local_synchronization: as torch: only the members need to call this; the others may
            skip it (or call it, as a no-op returning their non-member handle). The group's id is
            then derived from its member list and how many such groups these members created, not
            from the job-wide creation count, so skipping it leaves later groups in step.
        task_check: when collectives paired across ranks that different tasks (or threads)
            started are a ``CollectiveMismatchError`` (docs/guide.md, "Collectives from several
            tasks"): "auto" (default: ``AIODIST_TASK_CHECK``, else "auto") where the names show a
            race, "strict" whenever the names differ, "off" never (torch's way: matched by call
            order alone). Give the same on every rank.
    """
    w = world()
    check = w.settings.task_check if task_check is None else task_check
    if check not in _origin.TASK_CHECKS:  # (before any group id is taken)
        raise DistValueError(f"new_group: task_check must be one of 'auto', 'strict', 'off', got {check!r}")
    size = w.default_group.size
    if ranks is None:
        members = list(range(size))
    else:
        given = [int(r) for r in ranks]
        members = sorted(given) if sort_ranks else given
    for r in members:
        if not 0 <= r < size:
            raise DistValueError(f"new_group: rank {r} is not in the world of size {size}")
    if len(set(members)) != len(members):
        raise DistValueError(f"new_group: ranks {members} contain duplicates")
    engine = w.engine
    if backend is not None:
        kind = BACKENDS.get(str(backend).lower())
        if kind is None:
            raise DistValueError(
                f"new_group: unknown backend {backend!r} (use 'tcp', 'gloo', 'nccl' or 'torch-gloo')"
            )
        engine = None if kind == "tcp" else kind
        if engine is not None:
            _engine.check_available(engine)
    if use_local_synchronization:
        if engine is not None:
            raise DistValueError(
                f"new_group: use_local_synchronization=True needs aiodist's own transport; the {engine!r} "
                "engine creates its groups with every rank of the job (pass backend='gloo', or drop it)"
            )
        # Equal on the members (they create their groups in one order), whatever other ranks did.
        local_base = 1 << 48  # above any creation count: the two kinds of id never meet
        earlier = sum(1 for g in w.groups if g.gid >= local_base and list(g.ranks) == members)
        gid = local_base + (zlib.crc32(",".join(map(str, members)).encode()) << 16) + earlier
    else:
        gid = w.job.next_gid()
    t = w.default_group.timeout if timeout is None else as_seconds(timeout)
    assert w.job_store is not None
    runs_on = _backend_for(engine, w.staged, w.job_store, gid, w.host, w.device)
    group = ProcessGroup(
        w.transport, members, gid, timeout=t, backend=engine or "tcp", runs_on=runs_on, task_check=check
    )
    await _connect(group)
    w.groups.append(group)
    return group
