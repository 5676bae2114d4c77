"""The backend name the sync face's job was initialised with ("gloo", "tcp"): the one piece of
state of this face besides the runtime's default group (both die with ``destroy_process_group``).

Its own module, so that what reads it (``get_backend``, the profiler's record names) and what
sets it (``init_process_group``) need not import each other.
"""

from __future__ import annotations

from typing import Any

import aiodist.face.world as _world

__all__ = ["name_of", "set_name"]

_name: str | None = None


def set_name(name: str | None) -> None:
    """What ``init_process_group`` was asked for (None: no job)."""
    global _name
    _name = name


def name_of(group: Any = None) -> str:
    """The job's backend name, else that of ``group`` (None: the default group).

    Raises:
        DistValueError: no job (``aiodist.face.world.resolve_group``'s error).
    """
    pg = _world.resolve_group(group)
    return _name or pg.backend
