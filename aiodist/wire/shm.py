"""Shared-memory messages: the setup exchange carried on a peer's TCP connection, and the
records of a shared-memory ring. Pure: no I/O, no memory mapping.

Setup, per direction (the sender of a direction creates its segment)::

    both ends:  ShmHello(host, enabled)     who I am; whether I take part
    creator:    ShmOffer(name, nonce, pid, addr) | ShmDecline(reason, own=True)
    mapper:     ShmAccept(echo, cma) | ShmDecline(reason)
    creator:    ShmStart()                  my data to you goes through the segment from here

A ``ShmBell`` says "look at your rings and completions with me": the doorbell of a reader
that is not polling.

Ring records: a fixed prefix (``RECORD``: record length, header length, payload length), a
msgpack header, then the payload, padded to ``ALIGN`` bytes. A prefix whose header length is
``WRAP`` skips to the start of the ring. Headers:

    [DATA, gid, chan, n, fp]                      payload inline (eager)
    [DESC, gid, chan, n, fp, nbytes, pid, addr]   single copy: read ``nbytes`` at ``addr`` of ``pid``
    [PART, gid, chan, n, fp, nbytes]              the first piece of a message sent in pieces
    [MORE]                                        the next piece of that message
    [DROP]                                        the message in pieces ends here, withdrawn:
                                                  its send failed; drop what came of it
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

from aiodist.wire.frames import ProtocolError

__all__ = [
    "ALIGN",
    "DATA",
    "DESC",
    "DROP",
    "MORE",
    "PART",
    "RECORD",
    "WRAP",
    "RecordHeader",
    "ShmAccept",
    "ShmBell",
    "ShmDecline",
    "ShmHello",
    "ShmMessage",
    "ShmOffer",
    "ShmStart",
    "decode_record_header",
    "decode_shm",
    "record_size",
]

RECORD = struct.Struct("<IIQ")  # record length (padded), header length, payload length
ALIGN = 16
WRAP = 0xFFFFFFFF  # header length of a record that only skips to the ring's start

DATA = 0
DESC = 1
PART = 2
MORE = 3
DROP = 4

_NONCE = 16
_MAX_NAME = 255
_MAX_TEXT = 500


def record_size(header_len: int, payload_len: int) -> int:
    """Bytes one record takes in the ring, prefix and padding included."""
    n = RECORD.size + header_len + payload_len
    return (n + ALIGN - 1) & ~(ALIGN - 1)


@dataclass(frozen=True, slots=True)
class ShmHello:
    """Sent by both ends after the handshake: the host identity, and whether shared memory is on."""

    host: str
    enabled: bool

    def encode(self) -> list[Any]:
        return ["hello", self.host, self.enabled]


@dataclass(frozen=True, slots=True)
class ShmOffer:
    """The creator's segment: its name in the segment directory, the nonce written at its start,
    and where the creator maps it (pid, address), so the mapper can try a single-copy read."""

    name: str
    nonce: bytes
    pid: int
    addr: int

    def encode(self) -> list[Any]:
        return ["offer", self.name, self.nonce, self.pid, self.addr]


@dataclass(frozen=True, slots=True)
class ShmAccept:
    """The mapper saw the nonce; it wrote ``echo`` into the segment (the creator checks it);
    ``cma``: it could read the creator's memory directly (process_vm_readv)."""

    echo: bytes
    cma: bool

    def encode(self) -> list[Any]:
        return ["accept", self.echo, self.cma]


@dataclass(frozen=True, slots=True)
class ShmDecline:
    """A direction stays on TCP. ``own``: the sender will not write to us through memory (it has
    no segment, or the echo it read back differs); else it could not use the segment we offered."""

    reason: str
    own: bool = False

    def encode(self) -> list[Any]:
        return ["decline", self.reason[:_MAX_TEXT], self.own]


@dataclass(frozen=True, slots=True)
class ShmStart:
    """From this frame on the creator's data messages come through the segment."""

    def encode(self) -> list[Any]:
        return ["start"]


@dataclass(frozen=True, slots=True)
class ShmBell:
    """A doorbell: new records or completions wait in shared memory."""

    def encode(self) -> list[Any]:
        return ["bell"]


ShmMessage = ShmHello | ShmOffer | ShmAccept | ShmDecline | ShmStart | ShmBell


def _bad(what: str) -> ProtocolError:
    return ProtocolError(f"malformed shared-memory message: {what}")


def decode_shm(body: Any) -> ShmMessage:
    """The message of a shared-memory frame; ``ProtocolError`` on anything malformed."""
    if not isinstance(body, list) or not body or not isinstance(body[0], str):
        raise _bad("not a tagged list")
    tag, args = body[0], body[1:]
    if tag == "bell" and not args:
        return ShmBell()
    if tag == "start" and not args:
        return ShmStart()
    if tag == "hello" and len(args) == 2:
        host, enabled = args
        if isinstance(host, str) and len(host) <= _MAX_TEXT and type(enabled) is bool:
            return ShmHello(host, enabled)
    elif tag == "offer" and len(args) == 4:
        name, nonce, pid, addr = args
        if (
            isinstance(name, str)
            and 0 < len(name) <= _MAX_NAME
            and "/" not in name
            and not name.startswith(".")
            and isinstance(nonce, bytes)
            and len(nonce) == _NONCE
            and type(pid) is int
            and type(addr) is int
            and pid > 0
            and addr >= 0
        ):
            return ShmOffer(name, nonce, pid, addr)
    elif tag == "accept" and len(args) == 2:
        echo, cma = args
        if isinstance(echo, bytes) and len(echo) == _NONCE and type(cma) is bool:
            return ShmAccept(echo, cma)
    elif tag == "decline" and len(args) == 2:
        reason, own = args
        if isinstance(reason, str) and len(reason) <= _MAX_TEXT and type(own) is bool:
            return ShmDecline(reason, own)
    raise _bad(f"{tag!r} with {len(args)} fields")


class RecordHeader(NamedTuple):
    """A ring record's header, checked. ``nbytes``: the whole message's size (DATA: the payload's);
    ``pid``/``addr``: where a DESC's bytes are. (A named tuple: one is built per record read.)"""

    kind: int
    key: tuple[int, int, int]
    fp: list[Any] | None
    nbytes: int = 0
    pid: int = 0
    addr: int = 0


_MORE_HEADER = RecordHeader(MORE, (0, 0, 0), None)
_DROP_HEADER = RecordHeader(DROP, (0, 0, 0), None)
_new: Any = tuple.__new__


def decode_record_header(raw: Any, payload_len: int) -> RecordHeader:
    """A ring record's decoded msgpack header, checked against its payload length."""
    if type(raw) is not list or not raw:
        raise _bad("record header")
    kind = raw[0]
    if kind == MORE and len(raw) == 1 and type(kind) is int:
        return _MORE_HEADER
    if kind == DROP and len(raw) == 1 and type(kind) is int and payload_len == 0:
        return _DROP_HEADER
    n = len(raw)
    if (
        n < 5
        or type(kind) is not int
        or type(raw[1]) is not int
        or type(raw[2]) is not int
        or type(raw[3]) is not int
    ):
        raise _bad("record header")
    fp = raw[4]
    if fp is not None and type(fp) is not list:
        raise _bad("record fingerprint")
    key = (raw[1], raw[2], raw[3])
    if kind == DATA and n == 5:  # first: the common case
        header: RecordHeader = _new(RecordHeader, (DATA, key, fp, payload_len, 0, 0))
        return header
    if kind == PART and n == 6 and type(raw[5]) is int and raw[5] >= payload_len:
        return RecordHeader(PART, key, fp, raw[5])
    if kind == DESC and n == 8 and payload_len == 0 and all(type(v) is int and v >= 0 for v in raw[5:]):
        return RecordHeader(DESC, key, fp, raw[5], raw[6], raw[7])
    raise _bad(f"record of kind {kind} with {n} fields")
