"""torch's debug level: ``DebugLevel``, ``get_debug_level``, ``set_debug_level``, ``set_debug_level_from_env``.

aiodist keeps one level per process (``aiodist.settings``), read by every collective: ``DETAIL``
runs the all-rank agreement check before each one (torch's DETAIL mode checks the same). It
starts from ``AIODIST_DEBUG``, is read again from it by each ``init_process_group``, and these
functions set it, so what a torch program sets is what aiodist does:
``set_debug_level(DebugLevel.DETAIL)`` turns the check on for this process's next collective
(and sets ``AIODIST_DEBUG``, so the processes it starts inherit it). torch's own variable,
``TORCH_DISTRIBUTED_DEBUG``, is honoured too: ``set_debug_level_from_env`` (also run once when
``aiodist.sync`` is imported, as torch does at import) takes it when set, else ``AIODIST_DEBUG``.
"""

from __future__ import annotations

from aiodist import settings as _settings
from aiodist.errors import DistValueError
from aiodist.settings import DebugLevel

__all__ = ["DebugLevel", "get_debug_level", "set_debug_level", "set_debug_level_from_env"]


def get_debug_level() -> DebugLevel:
    """This process's level (OFF unless set)."""
    return _settings.debug_level()


def set_debug_level(level: DebugLevel | int | str) -> None:
    """Set this process's level (a ``DebugLevel``, its value or its name).

    Raises:
        DistValueError: not a level.
    """
    if isinstance(level, str):
        chosen = _settings.parse_debug_level(level, "the debug level")
    else:
        try:
            chosen = DebugLevel(int(level))
        except (ValueError, TypeError):
            raise DistValueError(
                f"not a debug level: {level!r} (use DebugLevel.OFF, INFO or DETAIL)"
            ) from None
    _settings.set_debug_level(chosen)


def set_debug_level_from_env() -> None:
    """Set the level from ``TORCH_DISTRIBUTED_DEBUG`` when set, else ``AIODIST_DEBUG`` (else OFF).

    Raises:
        DistValueError: the variable holds something other than OFF, INFO or DETAIL.
    """
    _settings.set_debug_level(_settings.debug_level_from_env())
