"""Helpers shared by the tests/faults/test_faults_*.py files (imported by spawned ranks too).

``record(row, what, seconds)`` appends a measurement to the JSON-lines file named by
``AIODIST_FAULT_TIMES`` (when set): that is how the README's fault table was measured::

    AIODIST_FAULT_TIMES=/tmp/faults.jsonl .venv/bin/python -m pytest -q tests/faults/test_faults_*.py
"""

from __future__ import annotations

import json
import os
import random
import struct
import time
from pathlib import Path

from aiodist.wire.frames import encode_frame


def record(row: int | str, what: str, seconds: float) -> None:
    path = os.environ.get("AIODIST_FAULT_TIMES")
    if not path:
        return
    line = json.dumps({"row": row, "what": what, "seconds": round(seconds, 4), "pid": os.getpid()})
    with open(path, "a") as f:
        f.write(line + "\n")


def mark(path: Path) -> None:
    """Write the wall-clock time into ``path`` (a moment another process measures from)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(repr(time.time()))
    tmp.rename(path)


def since(path: Path) -> float:
    """Seconds since the moment ``mark(path)`` recorded."""
    return time.time() - float(path.read_text())


class Trap:
    """Unpickling this touches ``path``: proof that a payload was (or was not) unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[Path]]:
        return (Path.touch, (Path(self.path),))


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def nested_msgpack_frame(depth: int) -> bytes:
    """A frame whose header is a msgpack list nested ``depth`` deep (a decoder bomb when deep)."""
    header = b"\x91" * depth + b"\xc0"
    return struct.pack("!IQ", len(header), 0) + header


def hostile_bytes(seed: int) -> dict[str, bytes]:
    """What a hostile or confused client may send to a port of aiodist's (FAULTS #11, #12), by name:
    the store's port and a peer port must drop each one, naming nothing they should not."""
    return {
        "connect-close": b"",
        "http": b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n",
        "random": random.Random(seed).randbytes(4096),
        "frame-2^62": struct.pack("!IQ", 16, 1 << 62),
        "header-2^31": struct.pack("!IQ", 1 << 31, 0),
        "nested-msgpack": nested_msgpack_frame(100_000),
        "half-frame": struct.pack("!IQ", 100, 0) + b"\x00" * 50,
        "not-a-hello": encode_frame(["welcome", -1, b""]),
    }
