"""The creator torch calls for every process group on "aiodist", and the meshes groups run on.

The default group connects every rank of the job through torch's store (whatever init method
torch used) and keeps that mesh for the groups created after it: ``new_group(ranks,
backend="aiodist")`` is then an aiodist group over the same connections (keyed apart by an
id derived from torch's group name, which every member agrees on). A group created while the
default group is not on aiodist (e.g. gloo) connects a mesh of its own among its members.
When ``aiodist.sync`` lends its job's connections (its init gives torch the same default group,
handing its job to this creator as the group's options, ``LentJob``: see
``aiodist.torch._default_group``), the default group and those after it run over them instead,
with ids of their own (``SHARED_GIDS``), and connect nothing.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiodist.backends.native import NATIVE
from aiodist.backends.staged import CudaStager, StagedBackend, Stager
from aiodist.errors import DistError
from aiodist.group import ProcessGroup
from aiodist.job import Job
from aiodist.rendezvous import local_address_towards, torchelastic
from aiodist.runtime.loop_thread import LoopThread, get_loop_thread
from aiodist.settings import Settings
from aiodist.store import PrefixStore
from aiodist.store.c10d import TorchStore
from aiodist.torch._adapter import Adapter
from aiodist.torch._build import ExtensionBuildError, load_extension
from aiodist.transport.base import Transport

__all__ = ["BACKEND_NAME", "SHARED_GIDS", "LentJob", "create_backend"]

BACKEND_NAME = "aiodist"

log = logging.getLogger("aiodist")


@dataclass(eq=False)
class _Mesh:
    """torch's view of a job: the groups torch made on its connections (for the default group
    the whole job's; a group made while the default group is not on aiodist has a job of its
    own among its members). The job runs ``teardown`` when it closes."""

    job: Job
    stager: Stager
    groups: list[ProcessGroup] = field(default_factory=list)
    closed: bool = False
    # False: the job is the sync face's (``LentJob``), closed by its destroy.
    owns_job: bool = True
    # Added to the id of every group on this mesh: apart from the sync face's own groups.
    gid_base: int = 0
    # The level of every group on this mesh: the Python-only one (lent meshes, unless "cpp").
    python_only: bool = False

    @property
    def transport(self) -> Transport:
        return self.job.transport

    def teardown(self, reason: str) -> None:
        """Fail what is in flight on torch's groups, free the staging memory (on the loop thread)."""
        global _job_mesh
        with _lock:
            if self.closed:
                return
            self.closed = True
            if _job_mesh is self:
                _job_mesh = None
        for g in self.groups:
            g.abort(reason)
        self.stager.close()


_lock = threading.Lock()
_job_mesh: _Mesh | None = None  # the default group's mesh, shared by later groups
# How many meshes this process has connected per torch group name. torch may hand a re-created
# group (destroy, then init again) the same store and name; the count keys each attempt's
# rendezvous apart, and is the same on every member (each creates the same groups in order).
_attempts: dict[str, int] = {}
_adapters: dict[str, Adapter] = {}  # by torch group name, while the group lives (see resync)
# What stages device tensors for the groups of a new mesh: CUDA tensors through pinned host
# memory (it touches nothing of CUDA until a CUDA tensor comes). Tests put a HostStager here
# (``set_stager_factory``) to run the staging path of every operation where there is no GPU.
_stager_factory: Callable[[], Stager] = CudaStager
#: Ids of torch's groups on the sync face's connections start here (the sync face numbers its
#: own groups from 0, and from 1 << 48 for groups of local synchronisation).
SHARED_GIDS = 1 << 62


def set_stager_factory(factory: Callable[[], Stager] | None) -> Callable[[], Stager]:
    """Make the stagers of meshes connected from now on with ``factory`` (None: CUDA's); the old one.

    For tests: ``set_stager_factory(HostStager)`` stages every CPU tensor of every operation
    of the backend through host buffers, as CUDA tensors are on a GPU machine.
    """
    global _stager_factory
    with _lock:
        old, _stager_factory = _stager_factory, (factory or CudaStager)
    return old


@dataclass(frozen=True)
class LentJob:
    """torch's ``pg_options`` for a default group on "aiodist" that runs over ``world``'s
    connections: how the sync face hands its job to torch (never a module global).

    ``world`` is the sync face's ``aiodist.face.world.World`` (its default group's rank and
    size must be the ones torch is given). The group is one of its own on those connections,
    its operations numbered apart from the sync face's; destroying it leaves them open.
    """

    world: Any


def _group_id(name: str) -> int:
    """The id keeping a group's messages apart on a shared mesh, equal on every member.

    torch names groups "0" (the default group), "1", "2"... in creation order on every rank,
    or by a hash of their ranks; a decimal name is its own id, any other a 60-bit hash.
    """
    if name.isdigit():
        return int(name)
    return (1 << 60) | int.from_bytes(hashlib.blake2b(name.encode(), digest_size=7).digest(), "big")


def _host_of(store: Any, settings: Settings) -> str:
    """The address peers reach this rank at: the interface towards torch's TCPStore host."""
    from torch._C._distributed_c10d import PrefixStore as TorchPrefixStore
    from torch._C._distributed_c10d import TCPStore

    s = store
    while isinstance(s, TorchPrefixStore):
        s = s.underlying_store
    if isinstance(s, TCPStore):
        return local_address_towards(s.host, settings)
    return local_address_towards(settings.master_addr or "127.0.0.1", settings)


async def _connect(store: Any, rank: int, size: int, name: str, timeout: float, settings: Settings) -> _Mesh:
    attempt = _attempts[name] = _attempts.get(name, 0) + 1
    # Under torchrun the store outlives a restart of the worker group, whose processes count
    # their groups from 1 again: the restart count keeps each attempt's keys apart.
    restart = settings.restart_attempt()
    aio_store = PrefixStore(f"aiodist/attempt_{restart}/{attempt}", TorchStore(store, timeout))
    secret = settings.secret
    if secret is None and settings.agent_store:
        secret = await torchelastic.peer_secret(aio_store)  # torchrun sets none; see that module
    job = await Job.join(
        aio_store,
        rank,
        size,
        group_name=f"torch/{name}",
        secret=secret,
        host=_host_of(store, settings),
        timeout=timeout,
        settings=settings,
    )
    with _lock:
        factory = _stager_factory
    mesh = _Mesh(job, factory())
    job.on_close(mesh.teardown)
    return mesh


def _close_mesh(lt: LoopThread, mesh: _Mesh, reason: str) -> None:
    """Close torch's view of a job, and the job where it is torch's own."""
    if mesh.closed:
        return
    if mesh.owns_job:
        lt.run(mesh.job.close(reason), timeout=30)  # (runs mesh.teardown)
        return

    def close() -> None:
        mesh.job.forget(mesh.teardown)
        mesh.teardown(reason)

    lt.call(close)


def create_backend(opts: Any, backend_options: Any) -> Any:
    """torch's creator (extended API): build the C++ backend for one group.

    Args:
        opts: torch's ``_DistributedBackendOptions`` (store, group_rank, group_size, timeout,
            group_id, global_ranks_in_group: empty for the default group).
        backend_options: torch's ``pg_options``: none, but the sync face's own ``LentJob``.
    Raises:
        ExtensionBuildError: the C++ extension cannot be built here.
        ValueError: ``pg_options`` was given; a combined device spec on the Python-only level.
        DistError: the spec puts CUDA tensors on NCCL and torch has no NCCL.
        DistTimeoutError, DistError: the group's members did not connect.
    """
    global _job_mesh
    lent = backend_options.world if isinstance(backend_options, LentJob) else None
    if (backend_options is not None and lent is None) or (lent is not None and opts.global_ranks_in_group):
        raise ValueError("the aiodist backend takes no pg_options")
    settings = Settings.read()  # a bad value fails here, before any rank connects
    others = _other_backends_in_group()
    if "cuda:nccl" in others and not _nccl_available():
        # torch would refuse the NCCL half itself, but only after this half connected every rank
        raise DistError(
            "the backend spec puts CUDA tensors on NCCL (cuda:nccl), and this torch "
            f"({_torch_version()}) was built without NCCL: torch cannot create that half of the "
            "group. Use 'aiodist' alone (CUDA tensors, where torch has CUDA, are staged through "
            "host memory) or 'cpu:aiodist,cuda:gloo'"
        )
    with _lock:
        python_only = _job_mesh is not None and _job_mesh.python_only and bool(opts.global_ranks_in_group)
    # Lending the sync face's world builds nothing unasked: the Python-only level unless "cpp".
    ext = None if python_only else _extension_or_none(settings.torch_backend, build=lent is None)
    if ext is None and others:
        # torch puts a Python group in the place of the whole group and creates no other
        # backend after it: the other devices' backends would be silently dropped.
        raise ValueError(
            f"the Python-only level of the aiodist backend cannot share a group with other backends "
            f"({', '.join(others)}): a combined device spec needs the C++ extension (this process "
            "runs the Python-only level: AIODIST_TORCH_BACKEND=python, or the extension cannot be "
            "built here); or put every device on aiodist"
        )
    lt = get_loop_thread()
    rank, size = int(opts.group_rank), int(opts.group_size)
    timeout = opts.timeout
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    name = str(opts.group_id)
    global_ranks = [int(r) for r in opts.global_ranks_in_group]
    is_default = not global_ranks

    with _lock:
        shared = _job_mesh if not is_default else None
        stale = _job_mesh if is_default else None
    if stale is not None:
        # A default group is created while the last one's mesh is open: torch never finished
        # creating that group (e.g. "cpu:aiodist,cuda:nccl" where torch has no NCCL fails after
        # the CPU half connected), so nothing can use the mesh: close it rather than leak it.
        _close_mesh(lt, stale, "the default process group was created again")
    if shared is not None and not shared.closed:
        mesh, owns, ranks, gid = shared, False, global_ranks, shared.gid_base | _group_id(name)
    else:
        if lent is not None:
            mesh = _lent_mesh(lent, rank, size, python_only=ext is None)
            lt.call(lambda: mesh.job.on_close(mesh.teardown))  # (closed with the sync face's job)
        else:
            mesh = lt.run(_connect(opts.store, rank, size, name, seconds, settings))
        owns, ranks, gid = True, list(range(size)), mesh.gid_base | (_group_id(name) if lent else 0)
        if is_default:
            with _lock:
                _job_mesh = mesh

    def make_group() -> ProcessGroup:
        label = "default group" if is_default else f"group {name}"
        staged = StagedBackend(NATIVE, mesh.stager)
        g = ProcessGroup(
            mesh.transport,
            ranks,
            gid,
            timeout=seconds,
            backend=BACKEND_NAME,
            name=label,
            runs_on=staged,
            task_check=mesh.transport.settings.task_check,
        )
        mesh.groups.append(g)
        mesh.transport.torch_groups[name] = g
        return g

    group = lt.call(make_group)

    def shutdown() -> None:
        with _lock:
            if _adapters.get(name) is adapter:
                del _adapters[name]
        if owns:
            _close_mesh(lt, mesh, "the process group was destroyed")
            return

        def drop() -> None:
            group.abort("the process group was destroyed")
            if mesh.transport.torch_groups.get(name) is group:
                del mesh.transport.torch_groups[name]
            if group in mesh.groups:
                mesh.groups.remove(group)

        if not mesh.closed:
            lt.call(drop)

    adapter = Adapter(group, lt, shutdown)
    with _lock:
        _adapters[name] = adapter
    if ext is None:
        from aiodist.torch._python_pg import PythonProcessGroup

        return PythonProcessGroup(rank, size, adapter, name)
    return ext.AiodistBackend(rank, size, adapter)


def _lent_mesh(world: Any, rank: int, size: int, *, python_only: bool) -> _Mesh:
    """The sync face's connections, for torch's default group (handed over as ``LentJob``)."""
    group = world.default_group
    if (rank, size) != (group.rank, group.size):
        raise DistError(
            f"torch's default group is rank {rank} of {size}, and the aiodist.sync job it should share "
            f"is rank {group.rank} of {group.size}"
        )
    with _lock:
        factory = _stager_factory
    return _Mesh(world.job, factory(), owns_job=False, gid_base=SHARED_GIDS, python_only=python_only)


def _nccl_available() -> bool:
    import torch.distributed

    return bool(torch.distributed.is_nccl_available())


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _other_backends_in_group() -> list[str]:
    """The "device:backend" pairs other than aiodist of the group torch is creating, if known.

    torch hands a backend's creator no word of the other devices' backends; its group-creating
    function holds them in its ``backend_config`` (torch 2.x), read here from the caller's frames.
    """
    import sys

    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != "_new_process_group_helper":
        frame = frame.f_back  # type: ignore[assignment]
    config = frame.f_locals.get("backend_config") if frame is not None else None
    mapping = getattr(config, "device_backend_map", None)
    if not isinstance(mapping, dict):
        return []
    return [f"{d}:{b}" for d, b in mapping.items() if str(b) != BACKEND_NAME]


def adapter_of(group_name: str) -> Adapter | None:
    """The adapter of this process's torch group named ``group_name`` on "aiodist", if any."""
    with _lock:
        return _adapters.get(group_name)


_warned_fallback = False


def _extension_or_none(level: str, build: bool = True) -> Any:
    """The C++ extension, or None for the Python-only level.

    ``level`` (``AIODIST_TORCH_BACKEND``): "cpp" (the extension or an error), "python" (the
    Python-only level), "auto" (the extension; where it cannot be built, the Python-only level
    with a warning that says what that level cannot do; with ``build=False``, the Python-only
    level: the first build takes tens of seconds).
    """
    global _warned_fallback
    if level == "python" or (level == "auto" and not build):
        return None
    try:
        return load_extension()
    except ExtensionBuildError as exc:
        if level == "cpp":
            raise
        if not _warned_fallback:
            _warned_fallback = True
            warnings.warn(
                f"{exc}\nFalling back to aiodist's Python-only torch backend: torch's collectives, "
                "point-to-point calls, object collectives, barriers, DistributedSampler, "
                "DistributedDataParallel, functional collectives, DTensor and FSDP2 work; a "
                "combined device spec such as 'cpu:aiodist,cuda:nccl' does not (it needs the "
                "extension). Set AIODIST_TORCH_BACKEND=cpp to make this an error.",
                RuntimeWarning,
                stacklevel=2,
            )
        return None
