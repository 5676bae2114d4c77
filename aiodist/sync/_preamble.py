"""torch's preamble of every operation of the blocking face, stated once: ``@torch_op(...)``.

Each torch.distributed operation starts the same way: skip it (with torch's warning) on a rank
that ``new_group`` left outside ``group`` (``GroupMember.NON_GROUP_MEMBER``), and accept its
root or peer either as a global rank (``src``/``dst``) or as a rank within ``group``
(``group_src``/``group_dst``). The decorator does both, so that the decorated function, which
keeps torch's signature, sees only a global rank in ``src``/``dst`` (``group_src``/``group_dst``
set to None) and states only what the operation itself does. ``async_op``, torch's profiler
record and non-contiguous tensors are ``_launch.run_op``'s part.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import aiodist.face.world as _world
from aiodist.errors import DistValueError

__all__ = ["ANY", "NON_GROUP_MEMBER", "global_rank", "not_in_group", "resolved", "torch_op"]

#: torch's ``GroupMember.NON_GROUP_MEMBER``: what ``new_group`` returns to a rank outside the group.
NON_GROUP_MEMBER = -100

F = TypeVar("F", bound=Callable[..., Any])

#: ``root_default`` for an operation whose root may be left out: any source (a receive).
ANY = object()


def global_rank(rank: int | None, group_rank: int | None, group: Any, arg: str, default: Any = None) -> Any:
    """The global rank from torch's ``src``/``dst`` or ``group_src``/``group_dst`` (a rank in ``group``).

    ``default``: what neither given means (None: one is required; ``ANY``: None, any source).
    """
    if group_rank is not None:
        if rank is not None:
            raise DistValueError(f"Can only specify one of {arg} or group_{arg}")
        pg = _world.resolve_group(group)
        if not isinstance(group_rank, int) or not 0 <= group_rank < pg.size:
            raise DistValueError(f"group_{arg}={group_rank!r} is not a rank of {pg.name} (size {pg.size})")
        return pg.ranks[group_rank]
    if rank is None:
        if default is None:
            raise DistValueError(f"Must specify either {arg} or group_{arg}")
        return None if default is ANY else default
    return rank


def resolved(rank: int | None) -> int:
    """The global root ``torch_op`` put in a required ``src``/``dst`` (never None there)."""
    assert rank is not None, "torch_op resolves a required root before the call"
    return rank


def torch_op(*, root: str | None = None, root_default: Any = None, skipped: Any = None) -> Callable[[F], F]:
    """Give the decorated operation torch's preamble.

    Args:
        root: the name of its global-rank argument ("src" or "dst"), whose group-rank twin is
            ``group_<root>``; None: the operation has no root.
        root_default: the root when neither is given: None (one is required), a global rank
            (torch's default 0), or ``ANY`` (None reaches the function: any source).
        skipped: what the operation returns on a rank outside ``group`` (torch's: None, or
            -1 for a receive).
    """

    def decorate(fn: F) -> F:
        name = fn.__name__
        params = list(inspect.signature(fn).parameters)
        at_group = params.index("group")
        at_root = params.index(root) if root is not None else -1
        at_group_root = params.index(f"group_{root}") if root is not None else -1

        def arg(args: tuple[Any, ...], kwargs: dict[str, Any], at: int, key: str) -> Any:
            return args[at] if at < len(args) else kwargs.get(key)

        @functools.wraps(fn)
        def op(*args: Any, **kwargs: Any) -> Any:
            group = arg(args, kwargs, at_group, "group")
            if not_in_group(group, name, stacklevel=4):
                return skipped
            if root is None:
                return fn(*args, **kwargs)
            assert root is not None
            group_key = f"group_{root}"
            given = arg(args, kwargs, at_root, root)
            group_given = arg(args, kwargs, at_group_root, group_key)
            if given is not None and group_given is None:
                return fn(*args, **kwargs)  # (the common case: a global rank, nothing to resolve)
            rank = global_rank(given, group_given, group, root, root_default)
            positional = list(args)
            for at, key, value in ((at_root, root, rank), (at_group_root, group_key, None)):
                if at < len(positional):
                    positional[at] = value
                else:
                    kwargs[key] = value
            return fn(*positional, **kwargs)

        return op  # type: ignore[return-value]

    return decorate


def not_in_group(group: Any, what: str, *, stacklevel: int = 3) -> bool:
    """True (after torch's warning) when ``group`` is ``GroupMember.NON_GROUP_MEMBER``.

    torch skips an operation called with a group this rank is not a member of; ``torch_op``
    does so for every operation of this face. ``stacklevel``: the warning's, as for
    ``warnings.warn`` counted from the caller of this function (3: the caller's caller).
    """
    if group is None or not isinstance(group, int) or group != NON_GROUP_MEMBER:
        return False
    rank = _world.get_rank() if _world.is_initialized() else -1
    warnings.warn(
        f"Running {what} on global rank {rank} which does not belong to the given group.",
        stacklevel=stacklevel,
    )
    return True
