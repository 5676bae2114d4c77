"""Length-prefixed frames: a fixed prefix, a msgpack header, then raw payload bytes.

Layout of one frame::

    +----------------+-------------------+----------------------+-------------------+
    | header_len u32 | payload_len u64   | header (msgpack)     | payload (raw)     |
    +----------------+-------------------+----------------------+-------------------+

Both lengths are checked against hard limits before a byte of either is stored, so a peer
announcing a 2**62-byte frame costs us 12 bytes. ``FrameReader`` is pure: it is handed the
bytes that arrived (via the ``get_buffer``/``buffer_updated`` pair that mirrors
``asyncio.BufferedProtocol``) and calls back with each header; the callback answers with
the buffer the payload should land in, so a large payload goes straight from the socket
into the tensor its receive was posted with, or ``PAUSE``: the frame is kept (header decoded,
payload unread) until ``resume()``, so a receiver can refuse to buffer a message it has no
room for and stop reading instead (backpressure without unbounded memory).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from aiodist.errors import DistError

__all__ = [
    "DEFAULT_LIMITS",
    "PAUSE",
    "PREFIX",
    "SKIP",
    "FrameReader",
    "Limits",
    "ProtocolError",
    "decode_header",
    "encode_frame",
]

PREFIX = struct.Struct("!IQ")


class ProtocolError(DistError):
    """The byte stream broke the protocol. The connection that carried it is poisoned."""


@dataclass(frozen=True, slots=True)
class Limits:
    """Hard bounds on what one frame may announce and what a header may contain."""

    max_header: int = 64 * 1024
    max_payload: int = 1 << 40
    max_str: int = 16 * 1024
    max_bin: int = 64 * 1024
    max_array: int = 4096
    max_map: int = 1024


DEFAULT_LIMITS = Limits()


class _Pause:
    """``on_header`` answer: keep this frame unread until ``FrameReader.resume()``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "PAUSE"


PAUSE: Any = _Pause()


class _Skip:
    """``on_header`` answer: read this frame's payload and drop it (no buffer of its size)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "SKIP"


SKIP: Any = _Skip()
_NOTHING = memoryview(b"")


_packers = threading.local()


def encode_frame(header: Any, payload_len: int = 0) -> bytes:
    """Prefix and header of one frame; the caller writes ``payload_len`` payload bytes after it."""
    # One Packer per thread, reused: ``msgpack.packb`` builds a new one per call, which is
    # half the cost of packing a small header (on the path of every message).
    try:
        packer = _packers.packer
    except AttributeError:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    packed: bytes = packer.pack(header)
    return PREFIX.pack(len(packed), payload_len) + packed


def decode_header(data: bytes | memoryview, limits: Limits = DEFAULT_LIMITS) -> Any:
    """Decode one msgpack header under ``limits``; any malformation is a ``ProtocolError``."""
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=limits.max_str,
            max_bin_len=limits.max_bin,
            max_array_len=limits.max_array,
            max_map_len=limits.max_map,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises a zoo of types (ValueError, ExtraData, StackError...)
        raise ProtocolError(f"malformed frame header: {exc.__class__.__name__}: {exc}") from None


# on_header(header, payload_len) -> where the payload goes (a writable memoryview of exactly
# payload_len bytes), None to have it collected into a fresh bytearray, SKIP to read and drop
# it (on_frame then gets an empty view), or PAUSE.
HeaderCallback = Callable[[Any, int], "memoryview | None"]
# on_frame(header, payload) -> called once the whole payload has arrived.
FrameCallback = Callable[[Any, memoryview], None]

_PREFIX, _HEADER, _PAYLOAD, _PAUSED = 0, 1, 2, 3

# After a frame with a payload this large, the next read into the scratch buffer is limited
# to _NARROW bytes: the next frame is likely large too, and whatever of its payload arrives
# with its header is copied out of the scratch buffer (up to the whole scratch, 256 KiB, per
# frame, before: 4% of the CPU of a 64 MiB all_reduce). Small frames keep the wide window,
# so that a burst of them is read in one system call.
_WIDE_AFTER = 64 * 1024
_NARROW = 4096


class FrameReader:
    """Incremental frame parser for a stream of bytes fed in arbitrary pieces."""

    __slots__ = (
        "_discard",
        "_expect",
        "_filled",
        "_header",
        "_limits",
        "_narrow",
        "_on_frame",
        "_on_header",
        "_payload_len",
        "_pos",
        "_scratch",
        "_scratch_view",
        "_sink",
        "_staged",
        "_state",
    )

    def __init__(
        self,
        on_header: HeaderCallback,
        on_frame: FrameCallback,
        limits: Limits = DEFAULT_LIMITS,
        scratch_size: int = 256 * 1024,
    ) -> None:
        self._on_header = on_header
        self._on_frame = on_frame
        self._limits = limits
        self._scratch = bytearray(max(scratch_size, PREFIX.size + limits.max_header))
        self._scratch_view = memoryview(self._scratch)
        # Bytes of the scratch buffer that arrived but are not consumed yet: [_pos, _filled).
        self._pos = 0
        self._filled = 0
        self._state = _PREFIX
        self._expect = PREFIX.size
        self._header: Any = None
        self._payload_len = 0
        self._sink: memoryview | None = None
        self._staged = 0  # payload bytes already in the sink
        self._discard = False  # this frame's payload is read and dropped (no sink)
        self._narrow = False  # the last frame was large: read the next header in a small window

    # -- BufferedProtocol-shaped feeding ------------------------------------------------
    def get_buffer(self) -> memoryview:
        """Where the next received bytes should be written (empty only while paused and full)."""
        if self._state == _PAYLOAD and self._pos == self._filled:
            if self._discard:  # into the scratch buffer, to be dropped
                self._pos = self._filled = 0
                return self._scratch_view[: min(len(self._scratch), self._payload_len - self._staged)]
            # Straight into the destination, never past the end of this frame's payload.
            assert self._sink is not None
            return self._sink[self._staged :]
        if self._pos == self._filled:
            self._pos = self._filled = 0
        elif len(self._scratch) - self._filled < 4096 and self._pos:
            # Compact: move the unconsumed tail to the front.
            n = self._filled - self._pos
            self._scratch[:n] = self._scratch[self._pos : self._filled]
            self._pos, self._filled = 0, n
        if self._narrow:
            return self._scratch_view[self._filled : self._filled + _NARROW]
        return self._scratch_view[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        """``nbytes`` were written into the last buffer ``get_buffer`` returned.

        While paused, bytes may still be handed in (they wait in the scratch buffer) as long
        as ``get_buffer`` had room for them; the owner is expected to stop reading.
        """
        if self._state == _PAYLOAD and self._pos == self._filled:
            self._staged += nbytes
            if self._staged == self._payload_len:
                self._finish_payload()
            self._drain()
            return
        self._filled += nbytes
        self._drain()

    def feed(self, data: bytes | bytearray | memoryview) -> int:
        """Feed bytes from anywhere (tests, non-buffered transports).

        Returns how many bytes were taken: all of them, unless the reader paused on a frame
        and its scratch buffer filled up (feed the rest after ``resume()``).
        """
        view = memoryview(data).cast("B")
        total = view.nbytes
        while view.nbytes:
            buf = self.get_buffer()
            n = min(len(buf), view.nbytes)
            if n == 0:
                break
            buf[:n] = view[:n]
            view = view[n:]
            self.buffer_updated(n)
        return total - view.nbytes

    @property
    def paused(self) -> bool:
        """True while a frame whose ``on_header`` answered ``PAUSE`` waits for ``resume()``."""
        return self._state == _PAUSED

    def resume(self) -> bool:
        """Ask ``on_header`` again about the paused frame and go on parsing what is buffered.

        Returns True if the reader is no longer paused.
        """
        if self._state != _PAUSED:
            return True
        self._state = _HEADER
        if not self._accept_header():
            return False
        self._drain()
        return self._state != _PAUSED

    def set_limits(self, limits: Limits, scratch_size: int = 256 * 1024) -> None:
        """Change the limits (and the scratch size) from the next frame on.

        For a connection that authenticates on small, strict limits and then switches to
        the data limits: bytes already buffered beyond the current frame are kept. Call it
        between frames (from ``on_header`` of a payload-less frame, or ``on_frame``).
        """
        self._limits = limits
        size = max(scratch_size, PREFIX.size + limits.max_header)
        if size != len(self._scratch):
            n = self._filled - self._pos
            scratch = bytearray(size)
            scratch[:n] = self._scratch_view[self._pos : self._filled]
            self._scratch, self._scratch_view = scratch, memoryview(scratch)
            self._pos, self._filled = 0, n

    def redirect(self, sink: memoryview | None) -> None:
        """Send the rest of the payload being read elsewhere: into ``sink`` (a view of the whole
        payload's size; what arrived so far is copied into it first), or with None nowhere (it
        is read and dropped). For a receive abandoned while its payload streams in: the bytes
        still to come must not land in the buffer its caller got back.
        """
        if self._state != _PAYLOAD:
            return
        if sink is None:
            self._sink, self._discard = None, True
            return
        if sink.nbytes != self._payload_len:
            raise ValueError(f"a sink of {sink.nbytes} bytes for a {self._payload_len}-byte payload")
        if self._sink is not None:
            sink[: self._staged] = self._sink[: self._staged]
        self._sink, self._discard = sink, False

    @property
    def receiving_payload(self) -> bool:
        """A frame's payload is being read (``redirect`` applies to it)."""
        return self._state == _PAYLOAD

    @property
    def mid_frame(self) -> bool:
        """True when a frame has begun but not ended (closing now would cut it in half)."""
        return self._state != _PREFIX or self._pos != self._filled

    # -- parsing -----------------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            avail = self._filled - self._pos
            if self._state == _PREFIX:
                if avail < PREFIX.size:
                    return
                hlen, plen = PREFIX.unpack_from(self._scratch, self._pos)
                if hlen > self._limits.max_header:
                    raise ProtocolError(
                        f"frame header of {hlen} bytes exceeds the limit of {self._limits.max_header}"
                    )
                if plen > self._limits.max_payload:
                    raise ProtocolError(
                        f"frame payload of {plen} bytes exceeds the limit of {self._limits.max_payload}"
                    )
                self._pos += PREFIX.size
                self._expect = hlen
                self._payload_len = plen
                self._state = _HEADER
            elif self._state == _HEADER:
                if avail < self._expect:
                    return
                raw = self._scratch_view[self._pos : self._pos + self._expect]
                self._pos += self._expect
                self._header = decode_header(raw, self._limits)
                if not self._accept_header():
                    return
            elif self._state == _PAUSED:
                return
            else:  # _PAYLOAD, with bytes still sitting in scratch
                if avail == 0:
                    return
                n = min(avail, self._payload_len - self._staged)
                if not self._discard:
                    assert self._sink is not None
                    self._sink[self._staged : self._staged + n] = self._scratch_view[
                        self._pos : self._pos + n
                    ]
                self._pos += n
                self._staged += n
                if self._staged == self._payload_len:
                    self._finish_payload()

    def _accept_header(self) -> bool:
        """Ask where the decoded header's payload goes; False when the answer is PAUSE."""
        sink = self._on_header(self._header, self._payload_len)
        if sink is PAUSE:
            self._state = _PAUSED
            return False
        self._staged = 0
        self._state = _PAYLOAD
        if sink is SKIP:
            self._sink, self._discard = None, True
            if self._payload_len == 0:
                self._finish_payload()
            return True
        if sink is None:
            sink = memoryview(bytearray(self._payload_len))
        elif sink.nbytes != self._payload_len:
            raise ProtocolError(f"payload sink of {sink.nbytes} bytes for a {self._payload_len}-byte payload")
        self._sink = sink.cast("B") if sink.format != "B" or sink.ndim != 1 else sink
        if self._payload_len == 0:
            self._finish_payload()
        return True

    def _finish_payload(self) -> None:
        header, sink = self._header, self._sink
        if sink is None:  # (dropped)
            sink = _NOTHING
        self._header = None
        self._sink = None
        self._discard = False
        self._staged = 0
        self._state = _PREFIX
        self._narrow = self._payload_len >= _WIDE_AFTER
        self._on_frame(header, sink)
