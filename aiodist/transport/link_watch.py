"""Finding peers whose host stopped answering: a cut link, a host that lost power.

Such a peer sends no FIN or RST: without help its connection looks alive until the group's
timeout (30 minutes by default), or until the kernel gives up retransmitting (about 15
minutes) where data was in flight. The help is two-fold:

* keepalive probes on every peer connection, from a quarter of the link timeout of silence
  on, so that an idle connection also has something its peer's host must acknowledge;
* a look at each connection's ``TCP_INFO`` every eighth of the link timeout: a connection with
  sent data or a keepalive probe waiting for an acknowledgement, whose peer's host has
  acknowledged nothing for the link timeout, is looked at again a second later (at most) and,
  still so, reported as silent. So a silent host is found within the link timeout plus an
  eighth of it and a second.

Acknowledgements come from the peer's kernel, not from its program: a rank that is stopped
(SIGSTOP, a debugger) or busy still acknowledges, so it is never reported. Nor is one that
leaves its receive buffer full: the sender then probes the closed window, and the kernel of
the receiver answers such probes at most every 500 ms (``tcp_invalid_ratelimit``) while the
sender's backoff stretches them to two minutes apart, so their answers say little; a
connection with unsent data and nothing in flight is left alone, unless its peer's kernel left
``WINDOW_PROBES`` of those probes in a row unanswered: each answer starts the kernel's count
(``tcpi_probes``) again, and the probes come at least 0.8 s apart from the third on, beyond the
answers' rate limit, so only a silent host leaves three unanswered (a window that closed just
before a link was cut: the reader paused for a large message, say). (``TCP_USER_TIMEOUT`` is no
help for that reason: Linux ends a connection whose window stayed closed that long, measured:
1 s with a reader paused for 3.) ``TCP_INFO`` is Linux's; elsewhere the kernel's keepalive
alone ends an idle connection after about the link timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import struct
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["LinkWatch"]

# struct tcp_info (linux/tcp.h): tcpi_probes (u8 at 3), tcpi_unacked (u32 at 24),
# tcpi_last_ack_recv (u32, ms, at 56), tcpi_notsent_bytes (u32 at 144, since Linux 4.6).
_TCP_INFO = getattr(socket, "TCP_INFO", None) if sys.platform.startswith("linux") else None
_TCP_INFO_BYTES = 148
_NOTSENT_AT = 144
WINDOW_PROBES = 3


def unanswered_ms(sock: Any) -> int:
    """Milliseconds the peer's host has left ``sock`` unacknowledged while sent data or a
    keepalive probe waited for its acknowledgement, or while ``WINDOW_PROBES`` probes of a closed
    window went unanswered in a row (0 when nothing waits, when a closed window's probes are
    answered, or where ``TCP_INFO`` is not available)."""
    if _TCP_INFO is None:
        return 0
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _TCP_INFO_BYTES)
    except OSError:
        return 0
    if len(info) < 60:
        return 0
    probes = info[3]
    (unacked,) = struct.unpack_from("I", info, 24)
    (last_ack_ms,) = struct.unpack_from("I", info, 56)
    # Probes with unsent data are the closed window's (see above); an older kernel that does
    # not say what is unsent gets the benefit of the doubt.
    keepalive = (
        probes > 0 and len(info) >= _TCP_INFO_BYTES and struct.unpack_from("I", info, _NOTSENT_AT)[0] == 0
    )
    return int(last_ack_ms) if unacked or keepalive or probes >= WINDOW_PROBES else 0


class LinkWatch:
    """Watches the peer connections of one transport; calls ``on_silent(peer, seconds)`` for a
    peer whose host has been silent for ``timeout`` seconds (then forgets it).

    Owned by its transport, which calls ``close()`` when it closes.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, timeout: float, on_silent: Callable[[int, float], None]
    ) -> None:
        self.loop = loop
        self.timeout = timeout
        self.on_silent = on_silent
        self._socks: dict[int, Any] = {}
        self._suspects: set[int] = set()
        self._timer: asyncio.TimerHandle | None = None

    def add(self, peer: int, sock: Any) -> None:
        """Watch ``sock``, the connection to ``peer``: keepalive probes on it, and the checks."""
        if self.timeout <= 0 or sock is None:
            return
        idle = max(1, int(self.timeout / 4))
        interval = max(1, int(self.timeout / 10))
        # The kernel's own verdict (keepalive's count of probes) comes a little after ours.
        count = math.ceil((self.timeout - idle) / interval) + 2
        for level, name, value in (
            (socket.SOL_SOCKET, "SO_KEEPALIVE", 1),
            (socket.IPPROTO_TCP, "TCP_KEEPIDLE", idle),
            (socket.IPPROTO_TCP, "TCP_KEEPINTVL", interval),
            (socket.IPPROTO_TCP, "TCP_KEEPCNT", count),
        ):
            opt = getattr(socket, name, None)
            if opt is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(level, opt, value)
        self._socks[peer] = sock
        if self._timer is None and _TCP_INFO is not None:
            self._timer = self.loop.call_later(self._period(), self._check)

    def remove(self, peer: int) -> None:
        self._socks.pop(peer, None)
        self._suspects.discard(peer)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._socks.clear()
        self._suspects.clear()

    def _period(self) -> float:
        return max(0.1, self.timeout / 8)

    def _check(self) -> None:
        self._timer = None
        limit_ms = self.timeout * 1000
        silent: list[tuple[int, float]] = []
        for peer, sock in self._socks.items():
            ms = unanswered_ms(sock)
            if ms < limit_ms:
                self._suspects.discard(peer)
            elif peer in self._suspects:
                # Twice in a row: not a probe caught in the instant before its answer.
                silent.append((peer, ms / 1000))
            else:
                self._suspects.add(peer)
        for peer, seconds in silent:
            self.remove(peer)
            self.on_silent(peer, seconds)
        if self._socks:
            # A suspect is looked at again soon: a probe's answer takes a round trip, not a period.
            delay = min(self._period(), 1.0) if self._suspects else self._period()
            self._timer = self.loop.call_later(delay, self._check)
