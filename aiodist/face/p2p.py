"""Point-to-point operations and barrier of the async face.

Each call starts the operation at once and returns its ``Work``; ``await`` it for the result
(None, or the sender's rank for ``recv``). Ranks are global ranks, as in torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiodist._docs import ASYNC_P2P, contract
from aiodist.errors import DistTypeError, DistValueError
from aiodist.face.world import resolve_group
from aiodist.work import Work

__all__ = ["P2POp", "batch_isend_irecv", "irecv", "isend", "recv", "send"]


@contract(ASYNC_P2P)
def send(tensor: Any, dst: int, group: Any = None, tag: int = 0, *, timeout: float | None = None) -> Work:
    """Send ``tensor`` to global rank ``dst``.

    The Work completes once ``tensor`` may be modified again. Messages from one rank to
    another with one tag arrive in the order they were sent.

    Args:
        tensor: the data (not to be modified until the Work completes).
        dst: the receiver's global rank.
        tag: matches a ``recv`` with the same tag.
        group: the group (default: the world).
        timeout: seconds for this operation instead of the group's timeout.
    Returns:
        A ``Work``, at once: await it (or ``wait()`` from another thread); its result is None.
    """
    return resolve_group(group).send(tensor, dst, tag, timeout)


@contract(ASYNC_P2P)
def recv(
    tensor: Any, src: int | None = None, group: Any = None, tag: int = 0, *, timeout: float | None = None
) -> Work:
    """Receive into ``tensor`` from global rank ``src`` (None: from any member of the group).

    The Work's result is the sender's global rank. On timeout the receive is withdrawn.

    Args:
        tensor: written with the message (same size and dtype as sent).
        src: the sender's global rank (None: any member).
        tag: matches a ``send`` with the same tag.
        group: the group (default: the world).
        timeout: seconds for this operation instead of the group's timeout.
    Returns:
        A ``Work``, at once: await it (or ``wait()`` from another thread); its result is
        the sender's global rank.
    """
    return resolve_group(group).recv(tensor, src, tag, timeout)


@contract(ASYNC_P2P)
def isend(tensor: Any, dst: int, group: Any = None, tag: int = 0, *, timeout: float | None = None) -> Work:
    """Same as ``send`` (every operation of the async face is non-blocking).

    Args:
        tensor, dst, tag: as ``send``.
        group: the group (default: the world).
        timeout: seconds for this operation instead of the group's timeout.
    Returns:
        A ``Work``, at once: await it (or ``wait()`` from another thread); its result is None.
    """
    return resolve_group(group).send(tensor, dst, tag, timeout)


@contract(ASYNC_P2P)
def irecv(
    tensor: Any, src: int | None = None, group: Any = None, tag: int = 0, *, timeout: float | None = None
) -> Work:
    """Same as ``recv`` (every operation of the async face is non-blocking).

    Args:
        tensor, src, tag: as ``recv``.
        group: the group (default: the world).
        timeout: seconds for this operation instead of the group's timeout.
    Returns:
        A ``Work``, at once: await it (or ``wait()`` from another thread); its result is
        the sender's global rank.
    """
    return resolve_group(group).recv(tensor, src, tag, timeout)


@dataclass(frozen=True, slots=True)
class P2POp:
    """One operation of ``batch_isend_irecv``: ``P2POp(dist.isend, tensor, peer)``.

    ``peer`` is a global rank; torch's ``group_peer`` (a rank within ``group``) is accepted instead.
    """

    op: Callable[..., Any]
    tensor: Any
    peer: int | None = None
    group: Any = None
    tag: int = 0
    group_peer: int | None = None

    def __post_init__(self) -> None:
        if _direction(self.op) is None:
            raise DistTypeError(
                "P2POp.op must be isend or irecv (of aiodist, aiodist.sync or torch.distributed)"
            )
        if self.peer is not None and self.group_peer is not None:
            raise DistValueError("P2POp takes either peer or group_peer, not both")
        if self.peer is None and self.group_peer is None and _direction(self.op) == "send":
            raise DistValueError("P2POp with isend needs a peer")


def _direction(op: Callable[..., Any]) -> str | None:
    name = getattr(op, "__name__", "")
    if name in ("isend", "send"):
        return "send"
    if name in ("irecv", "recv"):
        return "recv"
    return None


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list[Work]:
    """Start every operation of the list at once; returns their Works in the same order."""
    if not isinstance(p2p_op_list, Sequence) or not all(isinstance(p, P2POp) for p in p2p_op_list):
        raise DistTypeError("batch_isend_irecv takes a list of P2POp")
    groups = [resolve_group(p.group) for p in p2p_op_list]
    if groups and all(g is groups[0] for g in groups):
        whole = groups[0].batch_isend_irecv(p2p_op_list)  # a torch engine starts the list itself
        if whole is not None:
            return whole
    works = []
    for p, g in zip(p2p_op_list, groups, strict=True):
        peer = p.peer
        if p.group_peer is not None:
            if not 0 <= p.group_peer < g.size:
                raise DistValueError(
                    f"P2POp: group_peer={p.group_peer} is not a rank of {g.name} (size {g.size})"
                )
            peer = g.ranks[p.group_peer]
        if _direction(p.op) == "send":
            assert peer is not None  # checked in __post_init__
            works.append(isend(p.tensor, peer, g, p.tag))
        else:
            works.append(irecv(p.tensor, peer, g, p.tag))
    return works
