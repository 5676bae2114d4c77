"""In-process transport: every rank is a task on one event loop, messages are memory copies.

For fast algorithm tests over many world sizes; the TCP tier is tested separately with real
processes. A send copies the payload into the receiver's posted buffer (or into a held copy)
at once, so it completes immediately, like an eager-protocol send.
"""

from __future__ import annotations

import asyncio

from aiodist.errors import DistNetworkError
from aiodist.settings import Settings
from aiodist.transport.base import Fingerprint, Key, Transport
from aiodist.wire.control import Control, Goodbye

__all__ = ["MemoryFabric", "MemoryTransport"]


class MemoryFabric:
    """The shared medium of one in-process job: ``fabric.transports[r]`` is rank r's end."""

    def __init__(
        self,
        world_size: int,
        loop: asyncio.AbstractEventLoop | None = None,
        settings: Settings | None = None,
    ) -> None:
        loop = loop or asyncio.get_running_loop()
        settings = Settings.read() if settings is None else settings
        self.transports = [MemoryTransport(self, r, world_size, loop, settings) for r in range(world_size)]

    def kill(self, rank: int) -> None:
        """Simulate rank ``rank`` dying: every other rank sees it lost."""
        self.transports[rank].abort()


class MemoryTransport(Transport):
    def __init__(
        self,
        fabric: MemoryFabric,
        rank: int,
        world_size: int,
        loop: asyncio.AbstractEventLoop,
        settings: Settings | None = None,
    ) -> None:
        super().__init__(rank, world_size, loop, settings)
        self._fabric = fabric
        self._done: asyncio.Future[None] = loop.create_future()
        self._done.set_result(None)

    def send(
        self, dst: int, key: Key, payload: memoryview, fp: Fingerprint | None = None
    ) -> asyncio.Future[None]:
        if self.closed:
            raise DistNetworkError(f"rank {self.rank}: transport is closed")
        self._check_peer(dst, key)
        if not 0 <= dst < self.world_size:
            raise DistNetworkError(f"rank {self.rank}: no rank {dst} in a world of {self.world_size}")
        peer = self._fabric.transports[dst]
        peer.mailbox.deliver(
            self.rank, key, fp, payload.cast("B") if payload.format != "B" else payload, owned=False
        )
        return self._done

    def _send_mismatch(self, dst: int, key: Key, sent: Fingerprint | None, want: Fingerprint | None) -> None:
        peer = self._fabric.transports[dst]
        if not peer.closed:
            self.loop.call_soon(peer._mismatch_reported, self.rank, key, sent, want)

    def send_abort(self, dst: int, key: Key, reason: str, kind: str = "network") -> None:
        peer = self._fabric.transports[dst]
        if not peer.closed:
            self.loop.call_soon(peer._abort_reported, self.rank, key, reason, kind)

    def send_control(self, dst: int, msg: Control) -> None:
        peer = self._fabric.transports[dst]
        if not peer.closed and not self.closed and dst not in self.dead_peers:
            self.loop.call_soon(peer._control_received, self.rank, msg)

    async def aclose(self) -> None:
        """An orderly leave: peers fail only what still needs this rank."""
        self._close(graceful=True)

    def abort(self) -> None:
        """A crash, as seen by the peers: every group containing this rank breaks."""
        self._close(graceful=False)

    def _close(self, graceful: bool) -> None:
        if self.closed:
            return
        self.closed = True
        self.mailbox.fail_all(DistNetworkError(f"rank {self.rank}: transport closed"))
        for other in self._fabric.transports:
            if other is self or other.closed:
                continue
            if graceful:
                bye = self.goodbye or Goodbye()
                other._peer_left(self.rank, DistNetworkError(bye.describe(self.rank)))
            else:
                other._peer_lost(self.rank, DistNetworkError(f"rank {self.rank} closed its connection"))
