"""The parts of the operations' docstrings that a whole family of operations shares: the errors
and what a timeout or a lost member leaves behind, written once per face and kind.

``@contract(text)`` appends such a part to the docstring of the function it decorates, so
``help(aiodist.all_reduce)`` shows the whole contract while the source states it once. Put it
nearest the ``def`` (below decorators that copy the docstring, such as ``functools.wraps``).
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
    "ASYNC_COLLECTIVE",
    "ASYNC_OBJECTS",
    "ASYNC_P2P",
    "SYNC_COLLECTIVE",
    "SYNC_OBJECTS",
    "SYNC_P2P",
    "SYNC_P2P_STARTED",
    "async_collective",
    "contract",
    "sync_collective",
    "sync_p2p",
]

F = TypeVar("F", bound=Callable[..., Any])

_PICKLED = "Objects are pickled: receive them only from ranks you trust."
_TASKS = (
    ",\n        or paired operations that different tasks started (collectives are matched by call\n"
    "        order: tasks that share a group may start theirs in another order on each rank; give\n"
    "        each task its own group)"
)

# What a point-to-point size or dtype disagreement does, on both ends.
_REFUSED = (
    "A receive posted for another size or dtype than the message refuses it: the receive raises\n"
    "``CollectiveMismatchError`` naming both ranks and both sides, and the sender is told. Its send\n"
    "fails with the same error if it is still pending; a send that has completed (a small one\n"
    "completes once queued) cannot fail after the fact, so the next send to that rank with that tag\n"
    "raises the error at the call, before sending anything, and the refusal is logged when it\n"
    "arrives. Either way the tag then works again."
)


def _bad_argument(*, at_once: str, what: str = "tensor,\n        dtype, rank, list length") -> str:
    return (
        f"ValueError / TypeError (``DistValueError``, ``DistTypeError``): a bad argument ({what}), "
        f"raised {at_once} before anything is sent."
    )


def async_collective(refused: str = "", *, p2p: bool = False, pickled: bool = False) -> str:
    """The async face's errors and failure semantics; ``refused``: more that is refused at the call."""
    bad = _bad_argument(at_once="here at the call,")
    if refused:
        bad += "\n        " + refused
    after = (
        "the group goes on (stale messages of the operation are discarded; point-to-point operations\n"
        "never put a group out of step). A lost member breaks every group holding it:\n"
        f"destroy_process_group, then init again.\n\n{_REFUSED}"
        if p2p
        else "the group goes on (stale messages of the operation are discarded), unless the ranks\n"
        "disagree about which operations ran: then it is out of step until ``resync``. A lost member\n"
        "breaks every group holding it: destroy_process_group, then init again."
    )
    return (
        "Raises:\n"
        f"    {bad}\n"
        "    DistTimeoutError, DistNetworkError, CollectiveMismatchError: from awaiting the Work: the\n"
        "        timeout ran out (naming the ranks that did not arrive), a member was lost, or members\n"
        f"        called different operations or with different sizes, dtypes or roots{'' if p2p else _TASKS}.\n"
        "\n"
        "A timeout abandons the operation on this rank only: its outputs may hold partial data, and\n"
        f"{after}" + (f"\n{_PICKLED}" if pickled else "")
    )


def sync_collective(*, objects: bool = False, returned: str = "None") -> str:
    """The sync face's errors and failure semantics for a collective (``objects``: an object
    collective, which has no ``async_op``); ``returned``: what a non-member gets."""
    last = _PICKLED if objects else "With ``async_op=True`` these are raised by the Work's ``wait()``."
    return (
        "Raises:\n"
        f"    {_bad_argument(at_once='at the call')}\n"
        "    DistTimeoutError: the group's timeout ran out (the message names the ranks that did not\n"
        "        arrive); DistNetworkError: a member was lost; CollectiveMismatchError: members called\n"
        "        different operations, or with different sizes, dtypes or roots, or paired operations\n"
        "        that different threads started (threads sharing a group may call in another order on\n"
        "        each rank; give each thread its own group).\n"
        f"        {last}\n"
        "\n"
        "A timeout abandons the operation on this rank only: its outputs may hold partial data and the\n"
        "group goes on, unless the ranks disagree about which operations ran (then it is out of step\n"
        "until ``resync``). A lost member breaks every group holding it (destroy_process_group, then\n"
        "init again). On a rank outside ``group`` (``GroupMember.NON_GROUP_MEMBER``) nothing runs: torch's\n"
        f"warning, and {returned} is returned."
    )


def sync_p2p(*, started: bool = False, returned: str = "None") -> str:
    """The sync face's errors and failure semantics for point-to-point (``started``: a
    non-blocking one, whose errors come from its Work)."""
    later = "\n        These are raised by the Work's ``wait()``." if started else ""
    bad = _bad_argument(at_once="at the call", what="tensor,\n        rank")
    return (
        "Raises:\n"
        f"    {bad}\n"
        "    DistTimeoutError: the group's timeout ran out; DistNetworkError: the peer was lost;\n"
        f"        CollectiveMismatchError: the message and the receive disagree (below).{later}\n"
        "\n"
        "A timeout abandons the operation on this rank only (a receive's tensor may hold partial data;\n"
        "the receive is withdrawn) and the group goes on; a lost peer breaks every group holding it.\n"
        "On a rank outside ``group`` (``GroupMember.NON_GROUP_MEMBER``) nothing runs: torch's warning,\n"
        f"and {returned} is returned.\n\n{_REFUSED}"
    )


ASYNC_COLLECTIVE = async_collective()
ASYNC_OBJECTS = async_collective(pickled=True)
ASYNC_P2P = async_collective(p2p=True)
SYNC_COLLECTIVE = sync_collective()
SYNC_OBJECTS = sync_collective(objects=True)
SYNC_P2P = sync_p2p()
SYNC_P2P_STARTED = sync_p2p(started=True)


def contract(text: str) -> Callable[[F], F]:
    """Append ``text`` (written without indentation) to the decorated function's docstring."""

    def append(fn: F) -> F:
        own = (fn.__doc__ or "").rstrip()
        fn.__doc__ = f"{own}\n\n{textwrap.indent(text, '    ')}\n    "
        return fn

    return append
