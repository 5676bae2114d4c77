"""Connection handshake: protocol version, job, rank, and HMAC challenge-response.

Pure functions of (local, remote) shared by both ends, after dask's handshake. The acceptor
speaks first with a fresh nonce, so a recorded handshake can never be replayed::

    acceptor  -> connector : Challenge(version, nonce_a)
    connector -> acceptor  : Hello(version, job, rank, nonce_c, mac_c)
    acceptor  -> connector : Welcome(rank, mac_a)

    mac_c = HMAC(secret, "c" | nonce_a | nonce_c | job | rank_c)
    mac_a = HMAC(secret, "a" | nonce_c | nonce_a | job | rank_a)

Instead of a welcome the acceptor may answer ``Refusal(reason)``. ``Refusal(CROSSING)`` is not a
failure: two ranks dialed each other at once (peers connected on first use), and the one the
higher rank dialed is kept; the connector waits for it.

Without a secret the MACs are empty and only version and job are checked; with one, a peer
that cannot prove it knows the secret is refused before anything else it sent is decoded.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from typing import Any

from aiodist.wire.frames import ProtocolError

__all__ = [
    "CROSSING",
    "PROTOCOL_VERSION",
    "AuthError",
    "Challenge",
    "Hello",
    "Refusal",
    "Welcome",
    "accept_hello",
    "make_challenge",
    "make_hello",
    "make_welcome",
    "parse_challenge",
    "verify_welcome",
]

PROTOCOL_VERSION = 2  # 2: eager shared-memory records have a binary header (wire.shm)
NONCE_BYTES = 16
_MAX_REFUSAL = 500
CROSSING = "crossing: this rank dials you too; its connection is the one kept"


class AuthError(ProtocolError):
    """The peer failed authentication, or belongs to another job."""


@dataclass(frozen=True, slots=True)
class Challenge:
    version: int
    nonce: bytes

    def pack(self) -> list[Any]:
        return ["challenge", self.version, self.nonce]


@dataclass(frozen=True, slots=True)
class Hello:
    version: int
    job: str
    rank: int
    nonce: bytes
    mac: bytes

    def pack(self) -> list[Any]:
        return ["hello", self.version, self.job, self.rank, self.nonce, self.mac]


@dataclass(frozen=True, slots=True)
class Welcome:
    rank: int
    mac: bytes

    def pack(self) -> list[Any]:
        return ["welcome", self.rank, self.mac]


@dataclass(frozen=True, slots=True)
class Refusal:
    """The accepting side's answer instead of a welcome: why it drops the connection."""

    reason: str

    def pack(self) -> list[Any]:
        return ["refused", self.reason[:_MAX_REFUSAL]]


def _mac(secret: bytes | None, *parts: bytes) -> bytes:
    if not secret:
        return b""
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(4, "big"))
        h.update(p)
    return h.digest()


def _rank_bytes(rank: int) -> bytes:
    return rank.to_bytes(8, "big", signed=True)


def make_challenge() -> Challenge:
    return Challenge(PROTOCOL_VERSION, os.urandom(NONCE_BYTES))


def parse_challenge(msg: Any) -> Challenge:
    if not (isinstance(msg, list) and len(msg) == 3 and msg[0] == "challenge"):
        raise ProtocolError("expected a handshake challenge")
    _, version, nonce = msg
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"peer speaks protocol version {version!r}, we speak {PROTOCOL_VERSION}")
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise ProtocolError("malformed handshake nonce")
    return Challenge(version, nonce)


def make_hello(challenge: Challenge, job: str, rank: int, secret: bytes | None) -> Hello:
    nonce = os.urandom(NONCE_BYTES)
    mac = _mac(secret, b"c", challenge.nonce, nonce, job.encode(), _rank_bytes(rank))
    return Hello(PROTOCOL_VERSION, job, rank, nonce, mac)


def accept_hello(challenge: Challenge, msg: Any, job: str, secret: bytes | None) -> Hello:
    """Check a connector's hello against our challenge; raise ``AuthError`` if it fails."""
    if not (isinstance(msg, list) and len(msg) == 6 and msg[0] == "hello"):
        raise ProtocolError("expected a handshake hello")
    _, version, their_job, rank, nonce, mac = msg
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"peer speaks protocol version {version!r}, we speak {PROTOCOL_VERSION}")
    if not (
        isinstance(their_job, str)
        and isinstance(rank, int)
        and isinstance(nonce, bytes)
        and isinstance(mac, bytes)
    ):
        raise ProtocolError("malformed handshake hello")
    expected = _mac(secret, b"c", challenge.nonce, nonce, their_job.encode(), _rank_bytes(rank))
    if not hmac.compare_digest(expected, mac):
        raise AuthError("peer failed authentication (wrong or missing AIODIST_SECRET)")
    if their_job != job:
        raise AuthError(f"peer belongs to job {their_job!r}, not {job!r}")
    return Hello(version, their_job, rank, nonce, mac)


def make_welcome(challenge: Challenge, hello: Hello, job: str, rank: int, secret: bytes | None) -> Welcome:
    return Welcome(rank, _mac(secret, b"a", hello.nonce, challenge.nonce, job.encode(), _rank_bytes(rank)))


def verify_welcome(challenge: Challenge, hello: Hello, msg: Any, job: str, secret: bytes | None) -> Welcome:
    if not (isinstance(msg, list) and len(msg) == 3 and msg[0] == "welcome"):
        if isinstance(msg, list) and msg and msg[0] == "refused":
            raise AuthError(f"connection refused by peer: {msg[1] if len(msg) > 1 else 'no reason given'}")
        raise ProtocolError("expected a handshake welcome")
    _, rank, mac = msg
    if not (isinstance(rank, int) and isinstance(mac, bytes)):
        raise ProtocolError("malformed handshake welcome")
    expected = _mac(secret, b"a", hello.nonce, challenge.nonce, job.encode(), _rank_bytes(rank))
    if not hmac.compare_digest(expected, mac):
        raise AuthError("peer failed to prove it knows AIODIST_SECRET")
    return Welcome(rank, mac)
