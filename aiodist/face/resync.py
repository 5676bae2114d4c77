"""``resync``: the public call that brings a group back in step (``aiodist._recovery``)."""

from __future__ import annotations

from typing import Any

from aiodist.face.world import resolve_group
from aiodist.work import Work

__all__ = ["resync"]


def resync(group: Any = None, timeout: float | None = None) -> Work:
    """Bring ``group`` back in step after a failed collective; every member calls it.

    Call it on every rank after a ``DistTimeoutError``, ``GroupOutOfStepError`` or
    ``CollectiveMismatchError`` from a collective of the group. It is matched across ranks by
    its own count (the number of resyncs of the group), not by operation numbers, which may
    disagree by then. It fails this rank's collectives still in flight on the group, agrees on
    the next operation number (the largest any member proposes; messages of older operations
    are discarded from then on) and on which recent operations completed where.

    Args:
        group: the group (None: the default group).
        timeout: seconds to wait for every member's call (default: the group's timeout). When
            it runs out the group stays out of step and ``resync`` may be called again.
    Returns:
        A Work whose result is a ``ResyncReport``: ``next_op``, ``ranks_at`` (each rank's next
        operation number before), ``completed`` (which members completed each recent operation),
        ``disagreed`` (operations that completed on some members only), ``discarded``.
    Raises:
        DistNetworkError: a member was lost or has left (destroy the process group and init again).
        DistTimeoutError: a member did not call resync in time.
    """
    return resolve_group(group).resync(timeout)
