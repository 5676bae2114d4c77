"""One operation in flight on a group: what the group tracks and what recovery acts on."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

from aiodist.collectives.steps import Stepper
from aiodist.wire.fingerprint import Fingerprint
from aiodist.wire.messages import Key

__all__ = ["InFlight"]


class InFlight:
    """Bookkeeping of one operation in flight on a group (``ProcessGroup`` tracks them; timeouts,
    failures and resync act on them: ``aiodist._recovery``)."""

    __slots__ = (
        "cleanup", "deadline", "error", "future", "is_task", "key", "limit", "name", "on_timeout",
        "peer", "sent", "started", "stepper", "survives_loss",
    )  # fmt: skip

    def __init__(self, name: str, key: Key) -> None:
        self.name = name
        self.key = key
        self.future: asyncio.Future[Any] | None = None
        self.deadline = math.inf  # loop time at which it times out
        self.limit = 0.0  # its timeout in seconds
        self.error: BaseException | None = None
        self.is_task = False
        self.started = False  # a task's body has run its first step
        self.stepper: Stepper | None = None  # a collective run as steps (``ProcessGroup.run_steps``)
        self.cleanup: Callable[[], object] | None = None
        self.survives_loss = False  # a diagnostic that reports lost members itself
        # What its deadline fails it with, for an operation its backend's own engine runs
        # (``ProcessGroup.track_own``); None: a collective over the transport, whose timeout
        # starts the members' exchange about where they stand.
        self.on_timeout: Callable[[float], BaseException] | None = None
        # A pending send: (receiver, fingerprint of its message), so that the receiver's refusal
        # of the message fails it (``ProcessGroup.on_send_refused``).
        self.sent: tuple[int, Fingerprint] | None = None
        # A point-to-point operation's peer (None: a receive from any source, or a collective).
        self.peer: int | None = None
