"""torch's debug level: ``DebugLevel``, ``get_debug_level``, ``set_debug_level``, ``set_debug_level_from_env``.

aiodist has one switch, the ``AIODIST_DEBUG`` variable, read at every collective: ``DETAIL`` runs
the all-rank agreement check before each one (torch's DETAIL mode checks the same). These
functions read and write that switch, so what a torch program sets is what aiodist does:
``set_debug_level(DebugLevel.DETAIL)`` turns the check on for this process's next collective.
torch's own variable, ``TORCH_DISTRIBUTED_DEBUG``, is honoured too: ``set_debug_level_from_env``
(also run once when ``aiodist.sync`` is imported, as torch does at import) takes it when set, else
``AIODIST_DEBUG``.
"""

from __future__ import annotations

import enum
import os

from aiodist.errors import DistValueError

__all__ = ["DebugLevel", "get_debug_level", "set_debug_level", "set_debug_level_from_env"]

_VARIABLE = "AIODIST_DEBUG"
_TORCH_VARIABLE = "TORCH_DISTRIBUTED_DEBUG"


class DebugLevel(enum.IntEnum):
    """torch's levels: OFF (default), INFO, DETAIL (the agreement check before each collective)."""

    OFF = 0
    INFO = 1
    DETAIL = 2

    def __str__(self) -> str:
        return f"DebugLevel.{self.name}"


def _parse(text: str, variable: str) -> DebugLevel:
    try:
        return DebugLevel[text.strip().upper()]
    except KeyError:
        raise DistValueError(
            f"Invalid value for {variable}: {text!r}; valid values are OFF, INFO and DETAIL"
        ) from None


def get_debug_level() -> DebugLevel:
    """This process's level, as ``AIODIST_DEBUG`` says now (OFF when unset or empty)."""
    text = os.environ.get(_VARIABLE, "")
    if not text.strip():
        return DebugLevel.OFF
    try:
        return _parse(text, _VARIABLE)
    except DistValueError:
        return DebugLevel.OFF  # as the DETAIL check reads it: anything else is not DETAIL


def set_debug_level(level: DebugLevel | int | str) -> None:
    """Set this process's level (a ``DebugLevel``, its value or its name).

    Raises:
        DistValueError: not a level.
    """
    if isinstance(level, str):
        chosen = _parse(level, "the debug level")
    else:
        try:
            chosen = DebugLevel(int(level))
        except (ValueError, TypeError):
            raise DistValueError(
                f"not a debug level: {level!r} (use DebugLevel.OFF, INFO or DETAIL)"
            ) from None
    os.environ[_VARIABLE] = chosen.name


def set_debug_level_from_env() -> None:
    """Set the level from ``TORCH_DISTRIBUTED_DEBUG`` when set, else ``AIODIST_DEBUG`` (else OFF).

    Raises:
        DistValueError: the variable holds something other than OFF, INFO or DETAIL.
    """
    for variable in (_TORCH_VARIABLE, _VARIABLE):
        text = os.environ.get(variable, "")
        if text.strip():
            set_debug_level(_parse(text, variable))
            return
    os.environ.pop(_VARIABLE, None)
