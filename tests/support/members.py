"""A stand-in for a group attached to a transport (``Transport.attach``), for transport tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiodist.runtime.origin import OriginBook

Callback = Callable[..., None]


def _ignore(*_args: Any) -> None:
    pass


class StubMember:
    """Calls the callbacks it is given for what the transport tells a group; ignores the rest."""

    def __init__(self, *, on_control: Callback = _ignore, on_peer_lost: Callback = _ignore) -> None:
        self.origins = OriginBook()
        self.on_control = on_control
        self.on_peer_lost = on_peer_lost
        self.on_peer_gone: Callback = _ignore
        self.on_key_failed: Callback = _ignore
        self.on_send_refused: Callback = _ignore
