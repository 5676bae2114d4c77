"""The aiodist error family. One root, ``DistError``; torch's names below it.

Misuse (a wrong argument) raises ``DistValueError`` / ``DistTypeError``, which are also
``ValueError`` / ``TypeError`` so that ordinary ``except ValueError`` code keeps working; where
torch raises another built-in class for the same misuse, aiodist's class derives from it too
(``UnsupportedReduceError`` is a ``TypeError`` and, as torch's, a ``ValueError``).

Why these are not subclasses of torch's own ``torch.distributed.DistError`` family: torch is
optional, and ``import aiodist`` never imports it (a second of start-up, and a dependency a
numpy-only job does not have). Deriving from torch's classes only when torch happens to be
imported first would give one program two different hierarchies depending on import order.
So aiodist derives from the built-in classes torch's derive from (``RuntimeError`` for
``DistError``, ``TimeoutError``, ``ValueError``, ``TypeError``), and ``aiodist.sync`` exports
these under torch's names (``dist.DistError``, ``dist.DistBackendError``...): code written as
``except dist.DistError`` or ``except RuntimeError`` / ``except ValueError`` behaves the same on
either runtime; only a literal ``except torch.distributed.DistError`` does not see aiodist's.
This module imports nothing else of aiodist.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "CollectiveMismatchError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "DistTimeoutError",
    "DistTypeError",
    "DistValueError",
    "GroupOutOfStepError",
    "UnsupportedReduceError",
    "name_ranks",
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


class UnsupportedReduceError(DistTypeError, ValueError):
    """A reduce op that cannot reduce this dtype (bitwise on floats, MIN/MAX on complex...).

    A ``TypeError`` (the dtype is wrong for the op) and a ``ValueError``, the class torch raises
    for it ("all_reduce does not support ... on complex tensors").
    """


def name_ranks(ranks: Sequence[object], *, at_most: int | None = None) -> str:
    """``"rank 3"`` or ``"ranks 1, 2"``: how every error message names ranks.

    With ``at_most``, only that many are listed, then ``"and N more"``.
    """
    shown = list(ranks) if at_most is None else list(ranks[:at_most])
    text = ", ".join(map(str, shown))
    if at_most is not None and len(ranks) > at_most:
        text += f" and {len(ranks) - at_most} more"
    return ("rank " if len(ranks) == 1 else "ranks ") + text
