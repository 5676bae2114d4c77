"""``AIODIST_LOG_LEVEL``: the level of the ``aiodist`` logger, for programs that configure no logging.

``AIODIST_LOG_LEVEL=INFO`` (or DEBUG, WARNING, ERROR, CRITICAL, or a number) sets the level
of the ``aiodist`` logger and, when neither it nor the root logger has a handler (the program
configured no logging), adds one that writes to stderr. A program that configures logging
itself keeps its handlers and format; only the level is set.
"""

from __future__ import annotations

import logging
import os
import sys

from aiodist.errors import DistValueError

__all__ = ["configure_from_env"]

_NAMES = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _level(raw: str) -> int:
    text = raw.strip().upper()
    if text.lstrip("-").isdigit():
        return int(text)
    if text == "WARN":
        text = "WARNING"
    if text not in _NAMES:
        raise DistValueError(f"AIODIST_LOG_LEVEL={raw!r}: use one of {', '.join(_NAMES)} (or a number)")
    return int(getattr(logging, text))


def configure_from_env() -> None:
    """Apply ``AIODIST_LOG_LEVEL`` (a no-op when unset).

    Raises:
        DistValueError: the value is not a level.
    """
    raw = os.environ.get("AIODIST_LOG_LEVEL", "")
    if not raw.strip():
        return
    logger = logging.getLogger("aiodist")
    logger.setLevel(_level(raw))
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT))
    logger.addHandler(handler)
