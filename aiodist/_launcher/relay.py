"""Copies a worker's stdout/stderr to the console (prefixed ``[rank N]: ``), a log file and a tail.

The console gets whole lines only, each written and flushed in one piece, so that lines of
different ranks never interleave mid-line. A partial line (no newline yet) is held until its
newline arrives, the stream ends, it grows past ``MAX_LINE`` bytes, or no byte has come for
``IDLE_FLUSH`` seconds (a prompt or a progress bar); then it is printed as a line of its own and
never lost. Log files receive the bytes exactly as written, without prefixes.
"""

from __future__ import annotations

import asyncio
from typing import BinaryIO

__all__ = ["ConsoleWriter", "LineSplitter", "Tail", "pump"]

MAX_LINE = 64 * 1024
IDLE_FLUSH = 0.5
_CHUNK = 64 * 1024


class LineSplitter:
    """Cuts a byte stream into newline-terminated lines (pure; no I/O)."""

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self._buf = bytearray()
        self._max_line = max_line

    @property
    def pending(self) -> bool:
        """True if a partial line is held back."""
        return bool(self._buf)

    def feed(self, data: bytes) -> list[bytes]:
        """Adds ``data``; returns the lines it completed, each ending with ``b"\\n"``."""
        self._buf += data
        lines: list[bytes] = []
        end = self._buf.rfind(b"\n")
        if end >= 0:
            lines = [line + b"\n" for line in bytes(self._buf[:end]).split(b"\n")]
            del self._buf[: end + 1]
        # A line without end must not hold memory without bound: cut it into MAX_LINE pieces.
        while len(self._buf) >= self._max_line:
            lines.append(bytes(self._buf[: self._max_line]) + b"\n")
            del self._buf[: self._max_line]
        return lines

    def flush(self) -> list[bytes]:
        """Returns the held partial line, terminated, and forgets it (``[]`` if none)."""
        if not self._buf:
            return []
        line = bytes(self._buf) + b"\n"
        self._buf.clear()
        return [line]


class ConsoleWriter:
    """Writes prefixed lines to one of the launcher's binary streams."""

    def __init__(self, stream: BinaryIO, prefix: bytes) -> None:
        self._stream = stream
        self._prefix = prefix
        self._broken = False

    def write(self, lines: list[bytes]) -> None:
        """Writes ``lines`` in one call and flushes; stops quietly once the console is gone."""
        if not lines or self._broken:
            return
        try:
            self._stream.write(b"".join(self._prefix + line for line in lines))
            self._stream.flush()
        except (BrokenPipeError, ValueError, OSError):
            # The reader of our stdout went away (e.g. `| head`); keep draining the worker's pipe
            # so that the worker does not block on a full pipe.
            self._broken = True


class Tail:
    """Keeps the last bytes of a stream, to quote the end of a failed worker's stderr."""

    def __init__(self, max_bytes: int = 64 * 1024) -> None:
        self._buf = bytearray()
        self._max_bytes = max_bytes
        self._cut = False  # the oldest bytes were dropped: the first line kept may be partial

    def feed(self, data: bytes) -> None:
        """Appends ``data``, dropping the oldest bytes beyond the cap."""
        self._buf += data
        if len(self._buf) > self._max_bytes:
            del self._buf[: len(self._buf) - self._max_bytes]
            self._cut = True

    def lines(self, count: int | None = None) -> list[str]:
        """The last ``count`` (default: all kept) non-empty lines, decoded leniently."""
        text = self._buf.decode("utf-8", errors="replace")
        if self._cut:
            text = text.partition("\n")[2]
        lines = [line for line in text.splitlines() if line.strip()]
        return lines if count is None else lines[-count:]


async def pump(
    reader: asyncio.StreamReader,
    *,
    console: ConsoleWriter | None,
    log: BinaryIO | None,
    tail: Tail | None,
    idle_flush: float = IDLE_FLUSH,
) -> None:
    """Copies ``reader`` to its destinations until EOF.

    Cancellation stops the copy; a partial line held at that moment is printed first.
    """
    splitter = LineSplitter()
    try:
        while True:
            try:
                chunk = await asyncio.wait_for(reader.read(_CHUNK), idle_flush if splitter.pending else None)
            except TimeoutError:
                if console is not None:
                    console.write(splitter.flush())
                continue
            if not chunk:
                break
            if log is not None:
                log.write(chunk)
                log.flush()
            if tail is not None:
                tail.feed(chunk)
            lines = splitter.feed(chunk)
            if console is not None:
                console.write(lines)
    finally:
        if console is not None:
            console.write(splitter.flush())
