"""Which host-aware forms ran: the "op how" pairs of the algorithms' DEBUG notes on the
``aiodist`` logger (``all_reduce hierarchical``, ``all_gather two-level``)."""

from __future__ import annotations

import logging
import re

__all__ = ["HostAwarePaths"]

_NOTE = re.compile(r": \w+ #\d+: (\w+) (direct|hierarchical|host-ordered|two-level) ")


class HostAwarePaths(logging.Handler):
    """Collects "op how" from the host-aware algorithms' notes while attached (``attach``)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        m = _NOTE.search(record.getMessage())
        if m:
            self.seen.add(f"{m.group(1)} {m.group(2)}")

    def attach(self) -> HostAwarePaths:
        """Listen on the ``aiodist`` logger, at DEBUG level; returns itself."""
        logger = logging.getLogger("aiodist")
        logger.setLevel(logging.DEBUG)
        logger.addHandler(self)
        return self
