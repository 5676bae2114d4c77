"""A timeout argument (seconds or ``datetime.timedelta``) as float seconds."""

from __future__ import annotations

import datetime
from typing import Any

from aiodist.errors import DistTypeError

__all__ = ["as_seconds"]


def as_seconds(timeout: Any) -> float:
    """``timeout`` in seconds; refuses anything but a number (not a bool) or a ``timedelta``."""
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    if isinstance(timeout, int | float) and not isinstance(timeout, bool):
        return float(timeout)
    raise DistTypeError(f"timeout must be seconds or a datetime.timedelta, not {type(timeout).__name__}")
