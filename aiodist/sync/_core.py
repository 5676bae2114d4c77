"""torch.distributed-compatible lifecycle and point-to-point calls, blocking."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import aiodist._p2p as _p2p
import aiodist._world as _world
from aiodist.errors import DistTypeError
from aiodist.group import ProcessGroup
from aiodist.sync._bridge import call, run
from aiodist.work import Work

__all__ = [
    "GroupMember",
    "P2POp",
    "barrier",
    "batch_isend_irecv",
    "destroy_process_group",
    "get_backend",
    "get_rank",
    "get_world_size",
    "group",
    "init_process_group",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "new_group",
    "recv",
    "send",
]

P2POp = _p2p.P2POp


class GroupMember:
    """torch's ``GroupMember``: ``WORLD`` stands for the default group; ``NON_GROUP_MEMBER`` for none."""

    WORLD: Any = _world.WORLD
    NON_GROUP_MEMBER: Any = object()


group = GroupMember  # torch.distributed.group.WORLD


def is_available() -> bool:
    return True


def _unwrap_store(store: Any) -> Any:
    return getattr(store, "async_store", store)


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: datetime.timedelta | float | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: Any = None,
) -> None:
    """Blocking ``aiodist.init_process_group`` with torch's signature and defaults."""
    run(
        _world.init_process_group(
            backend or "tcp",
            init_method,
            rank=rank,
            world_size=world_size,
            timeout=1800.0 if timeout is None else timeout,
            store=_unwrap_store(store),
            group_name=group_name or "default",
            device_id=device_id,
        )
    )


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    run(_world.destroy_process_group(group))


def new_group(
    ranks: Sequence[int] | None = None,
    timeout: datetime.timedelta | float | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
) -> ProcessGroup:
    """Blocking ``aiodist.new_group``: every rank of the job calls it, in the same order."""
    return run(_world.new_group(ranks, timeout, backend))  # type: ignore[no-any-return]


def is_initialized() -> bool:
    return _world.is_initialized()


def get_rank(group: Any = None) -> int:
    return _world.get_rank(group)


def get_world_size(group: Any = None) -> int:
    return _world.get_world_size(group)


def get_backend(group: Any = None) -> str:
    return _world.get_backend(group)


def send(
    tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0, group_dst: int | None = None
) -> None:
    """Send ``tensor`` to global rank ``dst``; returns once ``tensor`` may be reused."""
    dst = _peer(dst, group_dst, group, "dst")
    call(lambda: _p2p.send(tensor, dst, group, tag), False)


def recv(
    tensor: Any, src: int | None = None, group: Any = None, tag: int = 0, group_src: int | None = None
) -> int:
    """Receive into ``tensor`` from global rank ``src`` (None: any); returns the sender's rank."""
    if group_src is not None:
        src = _peer(src, group_src, group, "src")
    return int(call(lambda: _p2p.recv(tensor, src, group, tag), False))


def isend(
    tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0, group_dst: int | None = None
) -> Work:
    dst = _peer(dst, group_dst, group, "dst")
    return call(lambda: _p2p.isend(tensor, dst, group, tag), True)  # type: ignore[no-any-return]


def irecv(
    tensor: Any, src: int | None = None, group: Any = None, tag: int = 0, group_src: int | None = None
) -> Work:
    if group_src is not None:
        src = _peer(src, group_src, group, "src")
    return call(lambda: _p2p.irecv(tensor, src, group, tag), True)  # type: ignore[no-any-return]


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Start every operation at once; returns the Works (call ``wait()`` on each)."""
    return run(_batch(p2p_op_list))  # type: ignore[no-any-return]


async def _batch(ops: list[P2POp]) -> list[Work]:
    return _p2p.batch_isend_irecv(ops)


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None) -> Work | None:
    """Wait until every member of ``group`` has entered the barrier."""
    return call(lambda: _p2p.barrier(group), async_op)  # type: ignore[no-any-return]


def _peer(rank: int | None, group_rank: int | None, group: Any, arg: str) -> int:
    """Accept torch's ``group_dst``/``group_src`` (a rank within ``group``) as well as global ranks."""
    if group_rank is not None:
        if rank is not None:
            raise DistTypeError(f"pass either {arg} or group_{arg}, not both")
        g = _world.resolve_group(group)
        return g.ranks[group_rank]
    if rank is None:
        raise DistTypeError(f"{arg} is required")
    return rank
