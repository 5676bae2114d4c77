"""torch.distributed-compatible lifecycle, group queries and point-to-point calls, blocking.

Signatures, defaults and return values are torch.distributed's (2.x), including its
compatibility quirks: ``new_group`` returns ``GroupMember.NON_GROUP_MEMBER`` to ranks outside
the group, and any operation called with it is skipped with a warning (``recv`` then returns
-1), as torch does. Ranks are global ranks; ``group_dst``/``group_src``/``group_peer`` take
ranks within ``group``.
"""

from __future__ import annotations

import datetime
import functools
import os
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

import aiodist.backends.torch_engine as _engine
import aiodist.face.p2p as _p2p
import aiodist.face.world as _world
from aiodist._docs import SYNC_P2P, SYNC_P2P_STARTED, contract, sync_p2p
from aiodist._tensors import NotContiguousError
from aiodist.errors import DistError, DistTypeError, DistValueError, UnsupportedReduceError
from aiodist.group import ProcessGroup
from aiodist.ops import ReduceOp, as_reduce_op
from aiodist.runtime.timeouts import as_seconds
from aiodist.settings import Settings
from aiodist.sync import _job_backend, _torch_default
from aiodist.sync._bridge import call, irecv_here, isend_here, on_loop, recv_here, run, send_here, start_p2p
from aiodist.sync._launch import profiling, run_op
from aiodist.sync._preamble import ANY, NON_GROUP_MEMBER, not_in_group, resolved, torch_op
from aiodist.work import Work

__all__ = [
    "Backend",
    "DistBackendError",
    "GroupMember",
    "P2POp",
    "batch_isend_irecv",
    "check_complex_op",
    "default_pg_timeout",
    "destroy_process_group",
    "get_backend",
    "get_default_backend_for_device",
    "get_global_rank",
    "get_group_rank",
    "get_node_local_rank",
    "get_pg_count",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "group",
    "init_process_group",
    "irecv",
    "is_available",
    "is_backend_available",
    "is_gloo_available",
    "is_initialized",
    "is_mpi_available",
    "is_nccl_available",
    "is_torchelastic_launched",
    "is_ucc_available",
    "is_xccl_available",
    "isend",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "not_in_group",
    "recv",
    "resync",
    "send",
    "supports_complex",
]

#: torch's default timeout of a process group (gloo): 30 minutes.
default_pg_timeout = datetime.timedelta(minutes=30)

#: torch's name for an error raised by the communication backend.
DistBackendError = DistError


class Backend(str):
    """torch's enum-like backend names: lower-case strings, ``Backend("GLOO") == "gloo"``.

    aiodist runs every backend name it accepts ("gloo", "tcp") on its own TCP transport;
    ``get_backend`` reports the name the job was initialised with.
    """

    UNDEFINED: ClassVar[str] = "undefined"
    GLOO: ClassVar[str] = "gloo"
    NCCL: ClassVar[str] = "nccl"
    UCC: ClassVar[str] = "ucc"
    MPI: ClassVar[str] = "mpi"
    XCCL: ClassVar[str] = "xccl"
    TCP: ClassVar[str] = "tcp"
    backend_list: ClassVar[list[str]] = [UNDEFINED, GLOO, NCCL, XCCL, UCC, MPI, TCP]
    default_device_backend_map: ClassVar[dict[str, str]] = {"cpu": GLOO, "cuda": NCCL}

    def __new__(cls, name: str) -> Backend:
        if not isinstance(name, str):
            raise DistValueError("Backend constructor parameter must be string-ish")
        value = getattr(Backend, name.upper(), None)
        return str.__new__(cls, value if isinstance(value, str) else name.lower())


class GroupMember:
    """torch's ``GroupMember``: ``WORLD`` is the default group; ``NON_GROUP_MEMBER`` is what
    ``new_group`` returns to a rank outside the new group."""

    WORLD: ClassVar[Any] = _world.WORLD
    NON_GROUP_MEMBER: ClassVar[int] = NON_GROUP_MEMBER


group = GroupMember  # torch.distributed.group.WORLD


class _NonMember(int):
    """What ``new_group`` returns to a rank outside the new group.

    Equal to ``GroupMember.NON_GROUP_MEMBER`` (-100), as torch's; it also remembers the
    group's ranks, so that ``get_process_group_ranks`` and the rank translations work on it.
    """

    ranks: tuple[int, ...]

    def __new__(cls, ranks: Sequence[int]) -> _NonMember:
        obj = int.__new__(cls, GroupMember.NON_GROUP_MEMBER)
        obj.ranks = tuple(ranks)
        return obj

    def __repr__(self) -> str:
        return f"GroupMember.NON_GROUP_MEMBER(ranks={list(self.ranks)})"


def seconds_of(timeout: datetime.timedelta | float | None) -> float | None:
    """torch's timeout (a ``timedelta`` or seconds; None: unset) in seconds."""
    return None if timeout is None else as_seconds(timeout)


# -- availability ---------------------------------------------------------------------------


def is_available() -> bool:
    """True: aiodist's distributed runtime is always available."""
    return True


def is_gloo_available() -> bool:
    """True: "gloo" runs on aiodist's TCP transport."""
    return True


def is_nccl_available() -> bool:
    """True where backend "nccl" can run: torch with NCCL, and a CUDA device."""
    try:
        _engine.check_available("nccl")
    except DistValueError:
        return False
    return True


def is_mpi_available() -> bool:
    """False: aiodist has no MPI backend (as torch built without MPI)."""
    return False


def is_ucc_available() -> bool:
    """False: aiodist has no UCC backend."""
    return False


def is_xccl_available() -> bool:
    """False: aiodist has no XCCL backend."""
    return False


def is_backend_available(backend: str) -> bool:
    """True for the backend names this build runs: "gloo", "tcp", and where torch can run them,
    "nccl" and "torch-gloo" (torch's own engines; see docs/torch.md, "CUDA tensors and NCCL")."""
    name = Backend(backend)
    if name in (Backend.GLOO, Backend.TCP):
        return True
    if name in _engine.ENGINE_BACKENDS:
        try:
            _engine.check_available(name)
        except DistValueError:
            return False
        return True
    return False


def get_default_backend_for_device(device: Any) -> str:
    """ "gloo" for the CPU, "nccl" for CUDA, as torch."""
    kind = device if isinstance(device, str) else getattr(device, "type", str(device))
    kind = kind.split(":")[0]
    try:
        return Backend.default_device_backend_map[kind]
    except KeyError:
        raise DistValueError(f"Default backend not registered for device : {device}") from None


def is_torchelastic_launched() -> bool:
    """True under ``aiodist-run`` (and torchrun): ``TORCHELASTIC_RUN_ID`` is set, as torch checks."""
    return os.getenv("TORCHELASTIC_RUN_ID") is not None


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """``LOCAL_RANK`` from the launcher's environment, else ``fallback_rank``.

    Raises:
        RuntimeError: neither is available.
    """
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError(
        "LOCAL_RANK is not in the environment. Consider passing fallback_rank to allow `get_node_local_rank` "
        "to work, assuming you are not running in a multi-device context and want the code to run locally instead."
    )


# torch refuses these on complex tensors (its ``supports_complex``): no order, no bits, and
# gloo has no complex product.
_NOT_FOR_COMPLEX = frozenset(
    {ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT, ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR}
)


def check_complex_op(what: str, op: Any, tensors: Sequence[Any]) -> None:
    """Refuse, as torch does, a reduce op it does not support on complex tensors.

    Raises:
        UnsupportedReduceError: (a ``ValueError``, as torch's) "all_reduce does not support ...".
    """
    rop = as_reduce_op(op)
    if rop not in _NOT_FOR_COMPLEX:
        return
    for t in tensors:
        is_complex = getattr(t, "is_complex", None)
        if (is_complex() if callable(is_complex) else np.iscomplexobj(t)) is True:
            raise UnsupportedReduceError(f"{what} does not support ReduceOp.{rop.name} on complex tensors")


def supports_complex(reduceOp: Any) -> bool:
    """True if ``reduceOp`` may reduce complex tensors here, as in torch (not MIN/MAX/PRODUCT, nor bitwise)."""
    try:
        check_complex_op("all_reduce", reduceOp, [np.zeros(1, np.complex64)])
    except DistTypeError:
        return False
    return True


# -- lifecycle ------------------------------------------------------------------------------


def _backend_for_cpu(backend: str | None) -> str:
    """torch's backend strings: "gloo", "GLOO", "cpu:gloo,cuda:nccl" -> the CPU entry."""
    if backend is None:
        return Backend.GLOO
    text = str(backend).strip()
    if ":" in text:
        entries = dict(part.split(":", 1) for part in text.split(",") if ":" in part)
        text = entries.get("cpu", next(iter(entries.values())))
    return str(Backend(text))


def _unwrap_store(store: Any) -> Any:
    return getattr(store, "async_store", store)


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: datetime.timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: Any = None,
    *,
    torch_default_group: str | None = None,
) -> None:
    """Join the job (blocking ``aiodist.init_process_group``) with torch's signature and defaults.

    Args:
        backend: "gloo" (default; runs on aiodist's TCP transport), "tcp", "nccl" (torch's
            NCCL engine), "torch-gloo" (torch's gloo engine), or torch's "cpu:gloo,cuda:nccl"
            form (its CPU entry is used).
        init_method: None / "env://", "tcp://host:port", "file:///path".
        timeout: ``timedelta`` (or seconds); default 30 minutes. Bounds the rendezvous and
            every later operation of the default group.
        world_size, rank: -1 takes them from the environment.
        store: a store (``aiodist.sync.TCPStore`` etc.) to rendezvous through.
        group_name: keeps jobs sharing an address or file apart.
        device_id: this rank's CUDA device (see ``aiodist.init_process_group``).
        pg_options: must be None: aiodist's backends take no backend options (torch's
            ``ProcessGroupNCCL.Options`` and the like are refused rather than ignored).
        torch_default_group: "auto", "1" or "0": whether torch.distributed gets this job as its
            default group too (below); None: ``AIODIST_TORCH_DEFAULT_GROUP``, else "auto".

    In a program that has imported torch, ``torch.distributed`` gets the same default group too
    (on the "aiodist" backend, over this job's connections), for torch's helpers such as
    ``DistributedSampler``; ``torch_default_group`` or ``AIODIST_TORCH_DEFAULT_GROUP`` (auto,
    1, 0) decides (see ``aiodist.sync._torch_default``), and ``destroy_process_group`` destroys
    it. (A program that makes torch's default group itself, say for gloo, passes "0".)

    Raises:
        DistTimeoutError: the rendezvous did not complete in time (names the missing ranks).
        DistValueError: bad arguments, the default group already exists, or torch's default
            group could not be made as ``AIODIST_TORCH_DEFAULT_GROUP`` asks (the job is then
            left again; the message says why and what to do).
    """
    _refuse_pg_options("init_process_group", pg_options)
    name = _backend_for_cpu(backend)
    settings = Settings.read()  # every variable, once: a bad value fails before the rendezvous
    for_torch = _torch_default.mode(torch_default_group, settings)
    run(
        _world.init_job(
            settings,
            name,
            init_method,
            rank=rank,
            world_size=world_size,
            timeout=default_pg_timeout if timeout is None else timeout,
            store=_unwrap_store(store),
            group_name=group_name or "default",
            device_id=device_id,
        )
    )
    _job_backend.set_name(name)
    try:
        _torch_default.initialise_for_torch(for_torch)
    except BaseException:
        destroy_process_group()
        raise


@torch_op()
def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Destroy ``group``, or with None every group and connection (the process may init again).

    With None, torch.distributed's default group made by ``init_process_group`` (and the groups
    torch made after it) are destroyed first, if torch still has it.
    """
    if group is None or group is GroupMember.WORLD:
        _job_backend.set_name(None)
        group = None
        _torch_default.release_for_torch()  # torch's default group runs on this job's connections
    run(_world.destroy_process_group(group))


def new_group(
    ranks: Sequence[int] | None = None,
    timeout: datetime.timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
    device_id: Any = None,
    sort_ranks: bool = True,
    *,
    task_check: str | None = None,
) -> Any:
    """Create a group of the global ``ranks`` (None: all). Every rank of the job calls it, in order.

    Args:
        sort_ranks: True (default) sorts ``ranks``; False keeps their order: position in
            ``ranks`` is the group rank (every rank passes the same list), as torch.
        use_local_synchronization: only the members need to call it, as torch (the others may
            skip the call); aiodist's transport only.
        task_check: "auto", "strict" or "off": when collectives that different threads started,
            paired across ranks, are a mismatch (``aiodist.new_group``).
    Returns:
        The group; ``GroupMember.NON_GROUP_MEMBER`` on a rank outside it, as torch (operations
        called with it are skipped).
    """
    _refuse_pg_options("new_group", pg_options)
    if backend is not None and not is_backend_available(backend):
        raise DistValueError(f"new_group: backend {backend!r} is not available (use 'gloo')")
    pg = run(
        _world.new_group(
            ranks,
            seconds_of(timeout),
            None if backend is None else str(Backend(backend)),
            sort_ranks=sort_ranks,
            use_local_synchronization=use_local_synchronization,
            task_check=task_check,
        )
    )
    return pg if pg.rank >= 0 else _NonMember(pg.ranks)


def _refuse_pg_options(what: str, pg_options: Any) -> None:
    """Backend options would change how torch's backend runs; aiodist has nowhere to honour
    them, so a script that passes some is told instead of having them silently dropped."""
    if pg_options is not None:
        raise DistValueError(
            f"{what}: pg_options ({type(pg_options).__name__}) is not supported: aiodist's backends "
            "take no backend options; pass pg_options=None"
        )


def new_subgroups(
    group_size: int | None = None,
    group: Any = None,
    timeout: datetime.timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> tuple[Any, list[Any]]:
    """Split ``group`` (default: the world) into groups of ``group_size`` consecutive ranks.

    ``group_size`` defaults to ``LOCAL_WORLD_SIZE`` (one group per node), where torch uses the
    number of CUDA devices. Returns ``(this rank's subgroup, every subgroup)``.
    """
    if group_size is None:
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local is None:
            raise DistValueError("new_subgroups: pass group_size (LOCAL_WORLD_SIZE is not set)")
        group_size = int(local)
    members = get_process_group_ranks(group)
    if group_size <= 0:
        raise DistValueError(f"The arg 'group_size' ({group_size}) must be positive")
    if group_size > len(members):
        raise DistValueError(
            f"The arg 'group_size' ({group_size}) must not exceed the world size ({len(members)})"
        )
    if len(members) % group_size != 0:
        raise DistValueError("The world size must be divisible by 'group_size'")
    chunks = [members[i : i + group_size] for i in range(0, len(members), group_size)]
    return new_subgroups_by_enumeration(chunks, timeout, backend, pg_options, group_desc)


def new_subgroups_by_enumeration(
    ranks_per_subgroup_list: Sequence[Sequence[int]],
    timeout: datetime.timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> tuple[Any, list[Any]]:
    """Create one group per list of global ranks. Returns ``(this rank's subgroup or None, all)``."""
    if not ranks_per_subgroup_list:
        raise DistValueError("The arg 'ranks_per_subgroup_list' cannot be empty")
    seen: set[int] = set()
    for ranks in ranks_per_subgroup_list:
        for r in ranks:
            if r in seen:
                raise DistValueError(f"Rank {r} has appeared in both subgroup {ranks} and an earlier one")
            seen.add(r)
    me = get_rank()
    cur: Any = None
    subgroups: list[Any] = []
    for ranks in ranks_per_subgroup_list:
        sub = new_group(ranks, timeout, backend, pg_options, group_desc=group_desc)
        subgroups.append(sub)
        if me in ranks:
            cur = sub
    return cur, subgroups


def is_initialized() -> bool:
    """True between ``init_process_group`` and ``destroy_process_group`` (of the world)."""
    return _world.is_initialized()


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (default: the world); -1 if it is not a member."""
    if isinstance(group, int) and group == GroupMember.NON_GROUP_MEMBER:
        return -1
    return _world.get_rank(group)


def get_world_size(group: Any = None) -> int:
    """The size of ``group`` (default: the world); -1 if this process is not a member."""
    if isinstance(group, int) and group == GroupMember.NON_GROUP_MEMBER:
        return -1
    pg = _world.resolve_group(group)
    return pg.size if pg.rank >= 0 else -1


def get_backend(group: Any = None) -> Backend:
    """The backend name the job was initialised with ("gloo" unless "tcp" was asked for)."""
    if isinstance(group, int) and group == GroupMember.NON_GROUP_MEMBER:
        raise DistValueError("Invalid process group specified")
    return Backend(_job_backend.name_of(group))


def _ranks_of(group: Any, what: str) -> tuple[int, ...]:
    """The global ranks of a group, of None (the world), or of a ``new_group`` non-member handle."""
    if isinstance(group, _NonMember):
        return group.ranks
    if isinstance(group, int) and group == GroupMember.NON_GROUP_MEMBER:
        raise DistValueError(f"{what}: this rank is not a member of the group (GroupMember.NON_GROUP_MEMBER)")
    return _world.resolve_group(group).ranks


def get_process_group_ranks(group: Any) -> list[int]:
    """The global ranks of ``group`` (None: the world), in group-rank order."""
    return list(_ranks_of(group, "get_process_group_ranks"))


def get_global_rank(group: Any, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (``group.WORLD``: the same number).

    Raises:
        ValueError: ``group`` is None or not a group, or ``group_rank`` is not in it (as torch).
    """
    if group is GroupMember.WORLD:
        return group_rank
    if group is None:
        raise DistValueError("Group None is not registered, please create group with new_group")
    ranks = _ranks_of(group, "get_global_rank")
    if not isinstance(group_rank, int) or not 0 <= group_rank < len(ranks):
        raise DistValueError(f"Group rank {group_rank} is not part of group {group!r}")
    return ranks[group_rank]


def get_group_rank(group: Any, global_rank: int) -> int:
    """The rank within ``group`` of global rank ``global_rank`` (``group.WORLD``: the same number).

    Raises:
        ValueError: ``group`` is None or not a group, or ``global_rank`` is not a member (as torch).
    """
    if group is GroupMember.WORLD:
        return global_rank
    if group is None:
        raise DistValueError("Group None is not registered, please create group with new_group")
    ranks = _ranks_of(group, "get_group_rank")
    try:
        return ranks.index(global_rank)
    except ValueError:
        raise DistValueError(f"Global rank {global_rank} is not part of group {group!r}") from None


def get_pg_count() -> int:
    """How many process groups this process has (the default group included)."""
    return len(_world.world().groups) if _world.is_initialized() else 0


# -- point-to-point -----------------------------------------------------------------------


@torch_op(root="dst")
@contract(SYNC_P2P)
def send(
    tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0, group_dst: int | None = None
) -> None:
    """Send ``tensor`` to global rank ``dst`` (or ``group_dst`` of ``group``).

    Returns once ``tensor`` may be modified again.

    Args:
        tensor: the data.
        dst: the receiver's global rank; or ``group_dst``, its rank within ``group``.
        group: the group (default: the world).
        tag: matches a receive with the same tag.
    Returns:
        None, once ``tensor`` may be modified again.
    """
    if not profiling() and send_here(tensor, resolved(dst), group, tag):
        return  # (on this thread: a small message to a peer of this host)
    run_op("send", lambda t: _p2p.send(t, resolved(dst), group, tag), False, tensor)


@torch_op(root="src", root_default=ANY, skipped=-1)
@contract(sync_p2p(returned="-1"))
def recv(
    tensor: Any, src: int | None = None, group: Any = None, tag: int = 0, group_src: int | None = None
) -> int:
    """Receive into ``tensor`` from global rank ``src`` (None: any member of ``group``).

    Args:
        tensor: written with the message (same size and dtype as sent).
        src: the sender's global rank (None: any member); or ``group_src``, its rank within ``group``.
        group: the group (default: the world).
        tag: matches a send with the same tag.
    Returns:
        The sender's global rank.
    """
    if src is not None and not profiling():
        done, sender = recv_here(tensor, src, group, tag)
        if done:
            return int(sender)  # (on this thread: a small message from a peer of this host)
    name = "recvAnySource" if src is None else "recv"  # gloo's record names
    return int(run_op(name, lambda t: _p2p.recv(t, src, group, tag), False, tensor))


@torch_op(root="dst")
@contract(SYNC_P2P_STARTED)
def isend(
    tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0, group_dst: int | None = None
) -> Work | None:
    """Start sending ``tensor``; returns the ``Work`` (``wait()`` before modifying ``tensor``).

    Args:
        tensor: the data.
        dst: the receiver's global rank; or ``group_dst``, its rank within ``group``.
        group: the group (default: the world).
        tag: matches a receive with the same tag.
    Returns:
        The ``Work``, at once; ``wait()`` before modifying ``tensor``.
    """
    if not profiling() and (sent := isend_here(tensor, resolved(dst), group, tag)) is not None:
        return sent  # (on this thread, complete: a small message to a peer of this host)
    start = functools.partial(_p2p.isend, dst=resolved(dst), group=group, tag=tag)
    return _start_nonblocking("send", "send", start, tensor, dst, group, tag)


@torch_op(root="src", root_default=ANY)
@contract(SYNC_P2P_STARTED)
def irecv(
    tensor: Any, src: int | None = None, group: Any = None, tag: int = 0, group_src: int | None = None
) -> Work | None:
    """Start receiving into ``tensor``; the Work's ``source_rank()`` is the sender once done.

    Args:
        tensor: written with the message (same size and dtype as sent).
        src: the sender's global rank (None: any member); or ``group_src``, its rank within ``group``.
        group: the group (default: the world).
        tag: matches a send with the same tag.
    Returns:
        The ``Work``, at once; once done, its ``source_rank()`` is the sender's global rank.
    """
    if src is not None and not profiling() and (got := irecv_here(tensor, src, group, tag)) is not None:
        return got  # (posted on this thread: a small message from a peer of this host)
    start = functools.partial(_p2p.irecv, src=src, group=group, tag=tag)
    name = "recvAnySource" if src is None else "recv"  # gloo's record names
    return _start_nonblocking(name, "recv", start, tensor, src, group, tag)


def _start_nonblocking(
    record: str, what: str, start: Any, tensor: Any, peer: Any, group: Any, tag: int
) -> Work:
    """Post a non-blocking send (``what="send"``) or receive without a round trip to the loop.

    Under torch's profiler, or for a non-contiguous tensor (copied in and out), it takes
    ``run_op``'s path instead, which records the operation as gloo names it (``record``).
    """
    if profiling():
        return run_op(record, start, True, tensor)  # type: ignore[no-any-return]
    try:
        return start_p2p(start, what, tensor, peer, group, tag)
    except NotContiguousError:
        return run_op(record, start, True, tensor)  # type: ignore[no-any-return]


#: torch's ``P2POp(op, tensor, peer=None, group=None, tag=0, group_peer=None)``.
P2POp = _p2p.P2POp


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Start every operation of the list at once; returns their Works (``wait()`` on each)."""
    ops = list(p2p_op_list)
    if any(not_in_group(p.group, "batch_isend_irecv") for p in ops):
        return []
    return on_loop(lambda: _p2p.batch_isend_irecv(ops))


def resync(group: Any = None, timeout: datetime.timedelta | float | None = None) -> Any:
    """Bring ``group`` back in step after a failed collective; every member calls it (blocking).

    Returns the ``ResyncReport`` (see ``aiodist.resync``).
    """
    seconds = seconds_of(timeout)
    return call(lambda: _world.resolve_group(group).resync(seconds), False)
