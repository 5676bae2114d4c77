"""The aiodist error family. One root, ``DistError``; torch's names below it.

Misuse (a wrong argument) raises ``DistValueError`` / ``DistTypeError``, which are also
``ValueError`` / ``TypeError`` so that ordinary ``except ValueError`` code keeps working.
This module imports nothing else of aiodist.
"""

from __future__ import annotations

__all__ = [
    "CollectiveMismatchError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "DistTimeoutError",
    "DistTypeError",
    "DistValueError",
    "GroupOutOfStepError",
]


class DistError(RuntimeError):
    """Base of every error aiodist raises."""


class DistTimeoutError(DistError, TimeoutError):
    """An operation, a store call or the rendezvous ran out of time."""


class DistNetworkError(DistError):
    """A peer was lost (connection reset, EOF, poisoned connection). The message names its rank."""


class DistStoreError(DistError):
    """The rendezvous store failed: unreachable, closed the connection, or refused us."""


class CollectiveMismatchError(DistError):
    """Ranks called different collectives, or the same one with different shapes, dtypes or roots."""


class GroupOutOfStepError(DistError):
    """The ranks of a group disagree about which of its collectives ran (after a timeout, a rank
    abandoned an operation another never entered or completed). Every collective on the group
    raises this at once until every member calls ``resync``; the message names the ranks and
    the operation numbers they are at."""


class DistValueError(DistError, ValueError):
    """A wrong argument value (misuse by the caller)."""


class DistTypeError(DistError, TypeError):
    """A wrong argument type (misuse by the caller)."""
