"""atheris target: what an authenticated peer may send to a ``TcpTransport``.

A connection already past the handshake (as rank 1 of a 3-rank job) is fed fuzzer bytes
through the same ``get_buffer``/``buffer_updated`` calls the event loop makes. Whatever it
sends, nothing may escape into the loop: a bad frame poisons that connection (the transport
aborts it), good frames land in the mailbox.
Run: ``python fuzz/fuzz_peer.py -max_total_time=600``.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import atheris

with atheris.instrument_imports():
    from aiodist.transport.tcp import PEER_LIMITS, TcpTransport, _PeerProtocol

LOOP = asyncio.new_event_loop()


class FakeTransport:
    """The asyncio transport methods the protocol calls."""

    def __init__(self) -> None:
        self.aborted = False

    def write(self, data: Any) -> None: ...
    def writelines(self, data: Any) -> None: ...
    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.aborted

    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...
    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def set_write_buffer_limits(self, high: int = 0, low: int = 0) -> None: ...


async def feed(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    owner = TcpTransport(0, 3, job="fuzz/1", secret=b"s", loop=LOOP)
    owner.mailbox.unexpected_cap = fdp.ConsumeIntInRange(1, 1 << 20)
    proto = _PeerProtocol(owner, connector=False)
    fake = FakeTransport()
    proto.transport = fake  # type: ignore[assignment]
    proto.peer = 1
    proto._reader.set_limits(PEER_LIMITS, 4096)
    owner._peers[1] = proto
    stream = fdp.ConsumeBytes(fdp.remaining_bytes())
    pos = 0
    while pos < len(stream) and not fake.aborted:
        buf = proto.get_buffer(-1)
        n = min(len(buf), len(stream) - pos, 997)
        if n == 0:
            break  # paused at the unexpected cap, as the real loop would be
        buf[:n] = stream[pos : pos + n]
        proto.buffer_updated(n)  # must never raise
        pos += n
    await asyncio.sleep(0)
    owner.abort()


def test_one(data: bytes) -> None:
    LOOP.run_until_complete(feed(data))


def main() -> None:
    atheris.Setup(sys.argv, test_one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
