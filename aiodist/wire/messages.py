"""The messages two ranks' transports exchange after the handshake: data, with pure codecs.

Every one travels as one frame (``aiodist.wire.frames``) whose header is a 5-item list::

    [kind, gid, chan, seq, body]      then the frame's payload (data messages only)

``(gid, chan, seq)`` is the key that matches a message to its receive; ``body`` depends on
the kind:

=========  ==============  ==========================================================
kind       message         body
=========  ==============  ==========================================================
0          ``Data``        the operation's fingerprint (a list) or None; payload follows
1          ``Mismatch``    ``[sent, want]``: the fingerprint received and the one expected
2          ``Abort``       ``[kind, reason]`` (a bare reason string from older peers)
3          ``Bye``         a ``Goodbye`` (``aiodist.wire.control``); a string from older peers
4          ``ControlFrame`` a control message (``aiodist.wire.control``); key ``(0, 0, 0)``
5          ``ShmFrame``    a shared-memory setup message or doorbell (``aiodist.wire.shm``)
6          ``Data``        as kind 0, but the receive completes on the ``Verdict`` that follows
7          ``Verdict``     ``True``: deliver the pending data message before it; ``False``: the
                           sender withdrew it (its send failed): drop it
=========  ==============  ==========================================================

A sender that hands the socket a reference to the caller's buffer (large payloads) sends kind 6:
until the socket has taken the last byte, the send may still fail (a timeout) and the caller
may then reuse its buffer, so the message is not the receiver's until the verdict says so. The
verdict is the very next frame on the connection.

``decode`` checks every field and raises ``ProtocolError`` on anything else, so the transport
can poison the connection instead of failing somewhere deeper. ``Data`` is a named tuple rather
than a dataclass: it is built for every message received, and a tuple is built in half the time
of a frozen dataclass; ``encode_data`` writes its header without building one at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from aiodist.wire.control import Control, Goodbye, decode_control
from aiodist.wire.fingerprint import Fingerprint
from aiodist.wire.frames import ProtocolError, encode_frame
from aiodist.wire.shm import ShmMessage, decode_shm

__all__ = [
    "KIND_ABORT",
    "KIND_BYE",
    "KIND_CTRL",
    "KIND_DATA",
    "KIND_MISMATCH",
    "KIND_SHM",
    "KIND_VERDICT",
    "Abort",
    "Bye",
    "ControlFrame",
    "Data",
    "Key",
    "Mismatch",
    "PeerMessage",
    "ShmFrame",
    "Verdict",
    "decode",
    "encode",
    "encode_data",
]

KIND_DATA = 0
KIND_MISMATCH = 1
KIND_ABORT = 2
KIND_BYE = 3  # an orderly goodbye: the peer is leaving, and says how (a Goodbye)
KIND_CTRL = 4  # a control message of a group, answered by the receiving runtime
KIND_SHM = 5  # shared memory between ranks of one host: its setup, and its doorbells
KIND_DATA_PENDING = 6  # data whose delivery waits for the Verdict that follows it
KIND_VERDICT = 7

# (group id, channel, sequence number): what matches a message to its receive.
Key = tuple[int, int, int]

_MAX_ABORT_KIND = 32
_MAX_ABORT_REASON = 4000
_MAX_LOSS_TEXT = 2000  # an older peer's goodbye: the loss that made it leave


class Data(NamedTuple):
    """A payload for the receive posted under ``key``; the frame's payload follows the header.

    ``pending``: the message is the receiver's only once the next frame, a ``Verdict``, says so.
    """

    key: Key
    fp: Fingerprint | None
    pending: bool = False


@dataclass(frozen=True, slots=True)
class Mismatch:
    """The receiver of ``key`` expected ``want`` but was sent ``sent``: the ranks disagree."""

    key: Key
    sent: Fingerprint | None
    want: Fingerprint | None

    def header(self) -> list[Any]:
        return [KIND_MISMATCH, *self.key, [self.sent, self.want]]


@dataclass(frozen=True, slots=True)
class Abort:
    """The sender gave up on ``key`` (``kind``: "network", "timeout", ...) for ``reason``."""

    key: Key
    reason: str
    kind: str = "network"

    def header(self) -> list[Any]:
        return [KIND_ABORT, *self.key, [self.kind[:_MAX_ABORT_KIND], self.reason[:_MAX_ABORT_REASON]]]


@dataclass(frozen=True, slots=True)
class Bye:
    """The sender leaves the job in order, and says how; nothing more comes from it."""

    goodbye: Goodbye

    def header(self) -> list[Any]:
        return [KIND_BYE, 0, 0, 0, self.goodbye.encode()]


@dataclass(frozen=True, slots=True)
class ControlFrame:
    """A control message for the receiving rank's runtime (never matched to a receive)."""

    control: Control

    def header(self) -> list[Any]:
        return [KIND_CTRL, 0, 0, 0, self.control.encode()]


@dataclass(frozen=True, slots=True)
class ShmFrame:
    """A message of the shared-memory path (``aiodist.wire.shm``): setup, or a doorbell."""

    message: ShmMessage

    def header(self) -> list[Any]:
        return [KIND_SHM, 0, 0, 0, self.message.encode()]


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether the pending data message just before it is delivered (True) or withdrawn."""

    deliver: bool

    def header(self) -> list[Any]:
        return [KIND_VERDICT, 0, 0, 0, self.deliver]


PeerMessage = Data | Mismatch | Abort | Bye | ControlFrame | ShmFrame | Verdict

# ``Data(key, fp)`` without the generated ``__new__``'s argument handling: a third of its cost,
# on every message received.
_new_data: Any = tuple.__new__


def encode_data(key: Key, fp: Fingerprint | None, nbytes: int, pending: bool = False) -> bytes:
    """Prefix and header of a data frame; the caller writes the ``nbytes`` of payload after it.

    The data path's encoder: the same bytes as ``encode(Data(key, fp, pending), nbytes)``, with
    no message object built.
    """
    return encode_frame([KIND_DATA_PENDING if pending else KIND_DATA, key[0], key[1], key[2], fp], nbytes)


def encode(msg: PeerMessage, nbytes: int = 0) -> bytes:
    """Prefix and header of one message's frame (``nbytes``: a data message's payload size)."""
    if isinstance(msg, Data):
        return encode_data(msg.key, msg.fp, nbytes, msg.pending)
    if nbytes:
        raise ValueError(f"a {type(msg).__name__} message carries no payload")
    return encode_frame(msg.header())


def decode(header: Any, nbytes: int) -> PeerMessage:
    """The message a decoded frame header (and a payload of ``nbytes``) carries.

    Raises:
        ProtocolError: the header is not one of the shapes above, or a message that carries
            no payload announced one. The text says what was malformed; the transport adds
            which rank sent it.
    """
    try:
        kind, gid, chan, seq, body = header
    except (TypeError, ValueError):
        raise ProtocolError("malformed message header") from None
    if not (type(kind) is int and type(gid) is int and type(chan) is int and type(seq) is int):
        raise ProtocolError("malformed message header")
    if kind in (KIND_DATA, KIND_DATA_PENDING):  # first: every payload comes this way
        if body is not None and type(body) is not list:
            raise ProtocolError("malformed message fingerprint")
        data: Data = _new_data(Data, ((gid, chan, seq), body, kind == KIND_DATA_PENDING))
        return data
    return _decode_notice(kind, (gid, chan, seq), body, nbytes)


def _decode_notice(kind: int, key: Key, body: Any, nbytes: int) -> PeerMessage:
    """The payload-less kinds."""
    if kind == KIND_MISMATCH:
        if nbytes or type(body) is not list or len(body) != 2 or not all(map(_is_fingerprint, body)):
            raise ProtocolError("malformed mismatch report")
        return Mismatch(key, body[0], body[1])
    if kind == KIND_ABORT:
        if type(body) is str:  # an older peer: the reason only, always a lost peer
            body = ["network", body]
        if nbytes or not (
            type(body) is list and len(body) == 2 and type(body[0]) is str and type(body[1]) is str
        ):
            raise ProtocolError("malformed abort notice")
        return Abort(key, body[1], body[0])
    if kind == KIND_BYE:
        if nbytes:
            raise ProtocolError("malformed goodbye")
        if type(body) is list:
            said = decode_control(body)
            return Bye(said if isinstance(said, Goodbye) else Goodbye())
        if type(body) is str:  # an older peer: the loss that made it leave
            return Bye(Goodbye(after_loss=body[:_MAX_LOSS_TEXT]))
        return Bye(Goodbye())
    if kind == KIND_CTRL:
        if nbytes:
            raise ProtocolError("malformed control message")
        return ControlFrame(decode_control(body))
    if kind == KIND_SHM:
        if nbytes:
            raise ProtocolError("malformed shared-memory message")
        return ShmFrame(decode_shm(body))
    if kind == KIND_VERDICT:
        if nbytes or type(body) is not bool:
            raise ProtocolError("malformed verdict")
        return Verdict(body)
    raise ProtocolError(f"unknown message kind {kind!r}")


def _is_fingerprint(value: Any) -> bool:
    return value is None or type(value) is list
