"""Shared-memory messages: the setup exchange carried on a peer's TCP connection, and the
records of a shared-memory ring. Pure: no I/O, no memory mapping.

Setup, per direction (the sender of a direction creates its segment)::

    both ends:  ShmHello(host, enabled)     who I am; whether I take part
    creator:    ShmOffer(name, nonce, pid, addr) | ShmDecline(reason, own=True)
    mapper:     ShmAccept(echo, cma, bell) | ShmDecline(reason)
    creator:    ShmStart()                  my data to you goes through the segment from here

A ``ShmBell`` says "look at your rings and completions with me": the doorbell of a reader
that is not polling, where it gave no doorbell of its own (``ShmAccept.bell``: a Unix datagram
socket the peer sends a byte to instead, far cheaper than a frame on either side).

Ring records: a fixed prefix (``RECORD``: record length, header length, payload length), a
header, then the payload, padded to ``ALIGN`` bytes. A prefix whose header length is ``WRAP``
skips to the start of the ring.

An eager data record, the record of every small message, has a fixed binary header
(``BIN_DATA``: its first byte ``BIN_TAG``, which no msgpack list starts with), read with one
``struct`` call::

    tag, chan, shape id, gid, n, seq          payload inline (eager)

The fingerprint travels as its *shape*, numbered per ring: the fingerprint without its sequence
number (which travels in the header), defined once by a ``SHAPE`` record before the first
record that uses it (``ShapeWriter``, ``ShapeReader``). Shape 0 is "no fingerprint". The other
headers are msgpack lists:

    [SHAPE, id, shape]                            the fingerprint shape numbered ``id``
    [DATA, gid, chan, n, fp]                      payload inline (eager), a fingerprint no
                                                  shape could carry (or past ``MAX_SHAPES``)
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
    "BIN_DATA",
    "BIN_TAG",
    "MAX_SHAPES",
    "RECORD",
    "SHAPE",
    "WRAP",
    "RecordHeader",
    "ShmAccept",
    "ShmBell",
    "ShmDecline",
    "ShmHello",
    "ShmMessage",
    "ShmOffer",
    "ShmStart",
    "ShapeReader",
    "ShapeWriter",
    "decode_record_header",
    "decode_shm",
    "record_size",
]

RECORD = struct.Struct("<IIQ")  # record length (padded), header length, payload length
BIN_DATA = struct.Struct("<BBxxIqqq")  # BIN_TAG, chan, shape id, gid, n, fingerprint's seq
BIN_TAG = 0x01  # (a msgpack list starts with 0x90-0x9F, 0xDC or 0xDD)
MAX_SHAPES = 4096  # shapes numbered per ring; fingerprints of others travel in msgpack
ALIGN = 16
WRAP = 0xFFFFFFFF  # header length of a record that only skips to the ring's start

DATA = 0
DESC = 1
PART = 2
MORE = 3
DROP = 4
SHAPE = 5

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
    ``cma``: it could read the creator's memory directly (process_vm_readv); ``bell``: the name
    of the datagram socket in the segment directory that wakes it ("": ring with ``ShmBell``)."""

    echo: bytes
    cma: bool
    bell: str = ""

    def encode(self) -> list[Any]:
        return ["accept", self.echo, self.cma, self.bell]


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
    elif tag == "accept" and len(args) == 3:
        echo, cma, bell = args
        if (
            isinstance(echo, bytes)
            and len(echo) == _NONCE
            and type(cma) is bool
            and isinstance(bell, str)
            and len(bell) <= _MAX_NAME
            and "/" not in bell
            and not bell.startswith(".")
        ):
            return ShmAccept(echo, cma, bell)
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


# A fingerprint's shape: the fingerprint with its sequence number (index 1 of a collective's
# seven items) left out, as a tuple (a dict key). A point-to-point fingerprint is its own shape.
_Shape = tuple[Any, ...]
_SEQ = 1
_COLLECTIVE_ITEMS = 7


def _shape_of(fp: list[Any]) -> tuple[_Shape, Any]:
    """A fingerprint's shape (without a collective's sequence number) and that number (0)."""
    if len(fp) == _COLLECTIVE_ITEMS:
        return (fp[0], None, *fp[2:]), fp[_SEQ]
    return tuple(fp), 0


class ShapeWriter:
    """The writing end's numbering of fingerprint shapes (one per ring).

    ``header(key, fp)`` gives the binary header of an eager data record, and the ``SHAPE``
    record that must precede it in the ring when its shape is new (else None). It gives None
    instead of a header when the fingerprint has no shape the header can carry (an item that
    is not hashable, a number out of the header's range), or when ``MAX_SHAPES`` are numbered
    already: the record then takes a msgpack header.
    """

    __slots__ = ("_ids", "_last", "_pack")

    def __init__(self, pack: Any) -> None:
        self._ids: dict[_Shape, int] = {}
        self._last: _Shape | None = None
        self._pack = pack  # (msgpack's, for the SHAPE records)

    def forget_last(self) -> None:
        """The ``SHAPE`` record of the last ``header`` found no room: its number is free again."""
        if self._last is not None:
            del self._ids[self._last]
            self._last = None

    def known(self, key: tuple[int, int, int], fp: list[Any] | None) -> bytes | None:
        """The binary header of a data record of ``key``/``fp`` whose shape is numbered already
        (or that has no fingerprint); None where ``header`` must be asked (a new shape, or one
        only msgpack carries). The compiled writer's reference (``transport.shm_eager``)."""
        if fp is not None:
            try:
                if _shape_of(fp)[0] not in self._ids:
                    return None
            except TypeError:  # (an item that is not hashable)
                return None
        return self.header(key, fp)[1]  # (defines nothing: the shape is known)

    def header(self, key: tuple[int, int, int], fp: list[Any] | None) -> tuple[bytes | None, bytes | None]:
        """``(shape record or None, binary header or None)`` for a data record of ``key``/``fp``."""
        define = None
        if fp is None:
            sid, seq = 0, 0
        else:
            shape, seq = _shape_of(fp)
            try:
                sid = self._ids.get(shape, 0)
            except TypeError:  # (an item that is not hashable)
                return None, None
            if not sid:
                if len(self._ids) >= MAX_SHAPES or type(seq) is not int:
                    return None, None
                sid = len(self._ids) + 1
                define = self._pack([SHAPE, sid, list(shape)])
                self._ids[shape] = sid
                self._last = shape
        try:
            return define, BIN_DATA.pack(BIN_TAG, key[1], sid, key[0], key[2], seq)
        except struct.error:  # (a number beyond 64 bits: msgpack carries it)
            return define, None


class ShapeReader:
    """The reading end's table of fingerprint shapes (one per ring), filled by ``SHAPE`` records."""

    __slots__ = ("_shapes",)

    def __init__(self) -> None:
        self._shapes: list[list[Any] | None] = [None]  # id 0: no fingerprint

    def define(self, raw: Any) -> None:
        """Take a decoded ``[SHAPE, id, shape]`` header; ids come in order, from 1."""
        if (
            type(raw) is not list
            or len(raw) != 3
            or type(raw[1]) is not int
            or raw[1] != len(self._shapes)
            or type(raw[2]) is not list
            or len(self._shapes) > MAX_SHAPES
        ):
            raise _bad("fingerprint shape record")
        self._shapes.append(raw[2])

    def data(self, raw: memoryview) -> tuple[tuple[int, int, int], list[Any] | None]:
        """The key and fingerprint of an eager data record's binary header (``BIN_DATA.size``
        bytes, the caller checked)."""
        _, chan, sid, gid, n, seq = BIN_DATA.unpack_from(raw)
        if sid >= len(self._shapes):
            raise _bad(f"fingerprint shape {sid} was never defined")
        shape = self._shapes[sid]
        if shape is None:
            return (gid, chan, n), None
        fp = list(shape)
        if len(fp) == _COLLECTIVE_ITEMS:
            fp[_SEQ] = seq
        return (gid, chan, n), fp
