"""What ``link_watch`` reads from a connection's ``TCP_INFO``: when its peer's host counts as
silent, and when it must not (a reader that merely leaves its buffer full)."""

from __future__ import annotations

import socket
import struct

import pytest

from aiodist.transport import link_watch

pytestmark = pytest.mark.skipif(link_watch._TCP_INFO is None, reason="TCP_INFO is Linux's")


class _Sock:
    """A socket whose ``TCP_INFO`` says what the test wants."""

    def __init__(self, *, probes: int, unacked: int, last_ack_ms: int, notsent: int) -> None:
        info = bytearray(link_watch._TCP_INFO_BYTES)
        info[3] = probes
        struct.pack_into("I", info, 24, unacked)
        struct.pack_into("I", info, 56, last_ack_ms)
        struct.pack_into("I", info, link_watch._NOTSENT_AT, notsent)
        self.info = bytes(info)

    def getsockopt(self, level: int, opt: int, size: int) -> bytes:
        assert (level, opt) == (socket.IPPROTO_TCP, link_watch._TCP_INFO)
        return self.info[:size]


def test_data_waiting_for_its_acknowledgement_counts_the_silence() -> None:
    assert link_watch.unanswered_ms(_Sock(probes=0, unacked=3, last_ack_ms=4200, notsent=0)) == 4200


def test_an_unanswered_keepalive_probe_counts_the_silence() -> None:
    assert link_watch.unanswered_ms(_Sock(probes=1, unacked=0, last_ack_ms=4200, notsent=0)) == 4200


def test_an_idle_connection_with_nothing_waiting_is_not_silent() -> None:
    assert link_watch.unanswered_ms(_Sock(probes=0, unacked=0, last_ack_ms=60_000, notsent=0)) == 0


@pytest.mark.parametrize("probes", [0, 1, 2])
def test_a_closed_window_whose_probes_are_answered_is_not_silent(probes: int) -> None:
    # A reader that leaves its buffer full: its kernel answers the probes (each answer starts the
    # count again; the first two may fall under its rate limit), however long ago the last
    # acknowledgement of data was.
    sock = _Sock(probes=probes, unacked=0, last_ack_ms=120_000, notsent=1 << 20)
    assert link_watch.unanswered_ms(sock) == 0


def test_a_closed_window_whose_probes_go_unanswered_counts_the_silence() -> None:
    # The window closed just before the link was cut: nobody answers the probes any more.
    sock = _Sock(probes=link_watch.WINDOW_PROBES, unacked=0, last_ack_ms=3600, notsent=1 << 20)
    assert link_watch.unanswered_ms(sock) == 3600
