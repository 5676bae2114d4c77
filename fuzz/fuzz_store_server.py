"""atheris target: the store server's request path, after authentication.

Bytes are parsed into frames with the server's limits, each frame validated by
``decode_request`` (``aiodist.wire.store``) and dispatched to a real ``StoreServer`` through a connection stand-in, on
one event loop. A request the server cannot accept must end in ``ProtocolError`` (the real
server then drops that connection); anything else escaping is a bug.
Run: ``python fuzz/fuzz_store_server.py -max_total_time=600``.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Sequence
from typing import Any

import atheris

with atheris.instrument_imports():
    from aiodist.store.memory import KeyTable
    from aiodist.store.server import SERVER_LIMITS, StoreServer
    from aiodist.wire.frames import FrameReader, ProtocolError
    from aiodist.wire.store import decode_request

LOOP = asyncio.new_event_loop()
SERVER = StoreServer("127.0.0.1", 0, secret=b"fuzz")


class FakeConn:
    """What ``StoreServer._dispatch`` needs of a connection: send() and the waiting tasks."""

    def __init__(self) -> None:
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.sent = 0

    def send(self, frame: bytes, values: Sequence[bytes] = ()) -> None:
        self.sent += 1


async def feed(stream: bytes) -> None:
    SERVER._table = KeyTable()  # every input starts from an empty store
    conn = FakeConn()
    frames: list[tuple[Any, memoryview]] = []
    reader = FrameReader(lambda h, n: None, lambda h, p: frames.append((h, p)), SERVER_LIMITS)
    with contextlib.suppress(ProtocolError):
        reader.feed(stream)
    try:
        for header, payload in frames:
            SERVER._dispatch(conn, decode_request(header, payload))  # type: ignore[arg-type]
    except ProtocolError:
        pass
    await asyncio.sleep(0)
    for task in conn.tasks.values():
        task.cancel()
    await asyncio.gather(*conn.tasks.values(), return_exceptions=True)


def test_one(data: bytes) -> None:
    LOOP.run_until_complete(feed(data))


def main() -> None:
    atheris.Setup(sys.argv, test_one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
