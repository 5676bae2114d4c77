"""The transport of a job: TCP between all ranks, shared memory for the data of ranks of one host.

``ShmTcpTransport`` is ``TcpTransport`` with a second path: after a peer's handshake the two
ends set up shared-memory rings (``shm.ShmPaths``) if they are on one host, and from then on
the data messages between them go through the rings. The TCP connection stays: it carries the
rings' setup and doorbells, and everything that is not data (control, aborts, mismatch
reports, goodbyes). With ``AIODIST_SHM=0`` the paths say so to each peer and TCP carries all.

Order across the two paths is kept where it matters: before a peer's TCP frame is handled,
what it wrote to its ring first is read; a peer that is gone has every record it wrote
delivered (or held) before the receives still waiting on it fail.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from aiodist.errors import DistNetworkError
from aiodist.native import compiled
from aiodist.runtime import busy_poll as _busy_poll
from aiodist.settings import Settings
from aiodist.transport import shm_here
from aiodist.transport.base import Fingerprint, Key
from aiodist.transport.shm import SETUP_TIMEOUT, ShmPaths
from aiodist.transport.tcp import TcpTransport, _How, _PeerProtocol
from aiodist.wire.frames import ProtocolError
from aiodist.wire.messages import PeerMessage, ShmFrame
from aiodist.wire.messages import encode as encode_message
from aiodist.wire.shm import ShmBell, ShmMessage

__all__ = ["ShmTcpTransport"]

_BELL_FRAME = encode_message(ShmFrame(ShmBell()))  # the doorbell of shared memory, sent often


class ShmTcpTransport(TcpTransport):
    """TCP to every peer; shared memory for the data messages of the peers of this host."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        job: str,
        secret: bytes | None,
        loop: asyncio.AbstractEventLoop | None = None,
        settings: Settings | None = None,
    ) -> None:
        super().__init__(rank, world_size, job=job, secret=secret, loop=loop, settings=settings)
        self._shm = ShmPaths(
            rank,
            self.loop,
            self.mailbox,
            job,
            self.settings,
            send_frame=self._send_shm_frame,
            room_for=self._room_for,
            reserve=self._reserve,
            closing=lambda: self._closing,
            broken=self._shm_broken,
        )
        if self._shm.enabled:
            _busy_poll.for_loop(self.loop).add_source(self._shm)

    async def shm_settled(self, timeout: float = SETUP_TIMEOUT) -> None:
        """Wait (at most ``timeout`` s) until every peer's shared-memory setup has concluded;
        a setup still under way after it goes on in the background (TCP carries data meanwhile)."""
        self._shm.expect(list(self._peers))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._shm.settled), timeout)

    def local_peers(self) -> list[int]:
        return self._shm.local_peers()

    @property
    def host_id(self) -> str:
        """This rank's host identity (``aiodist.runtime.host.host_id``)."""
        return self._shm.host

    @property
    def shm_bytes(self) -> tuple[int, int]:
        """Payload bytes sent and received through shared memory so far."""
        return self._shm.bytes_sent, self._shm.bytes_received

    @property
    def here_counts(self) -> tuple[int, int]:
        """Messages sent and received on a blocking caller's own thread so far (shm_here)."""
        return self._shm.sent_here, self._shm.received_here

    # -- operations ------------------------------------------------------------------------
    @property
    def serves_here(self) -> bool:
        return compiled("aiodist.transport._shm_eager") is not None and not self._closing

    def send_here(
        self, dst: int, key: Key, payload: memoryview, fp: Fingerprint | None
    ) -> asyncio.Future[None] | None:
        if (
            dst not in self._peers
            or dst in self.dead_peers
            or self._closing
            or self.mailbox.was_abandoned(key)
        ):
            return None
        return shm_here.send_here(self._shm, dst, key, payload, fp)

    def recv_here(
        self, src: int, key: Key, buf: memoryview, fp: Fingerprint | None, budget: float
    ) -> asyncio.Future[int] | None:
        if src not in self._peers or self._closing:
            return None
        return shm_here.recv_here(self._shm, src, key, buf, fp, budget)

    def post_here(
        self, src: int, key: Key, buf: memoryview, fp: Fingerprint | None
    ) -> asyncio.Future[int] | None:
        if src not in self._peers or self._closing:
            return None
        return shm_here.post_here(self._shm, src, key, buf, fp)

    def wait_here(self, src: int, key: Key, fut: asyncio.Future[int], budget: float | None) -> bool:
        return shm_here.wait_here(self._shm, src, key, fut, budget)

    def look_here(self, peers: Sequence[int], on: bool) -> None:
        shm_here.look_here(self._shm, peers, on)

    def finish_here(self, key: Key) -> bool:
        return shm_here.finish_here(self._shm, key)

    def abandon(self, key: Key) -> None:
        super().abandon(key)
        self._shm.abandon(key)
        self._schedule_retry()  # (a record waiting in a ring may belong to it)

    def cancel_recv(self, fut: asyncio.Future[int]) -> None:
        super().cancel_recv(fut)
        self._shm.release_receive(fut)

    def cancel_send(self, dst: int, fut: asyncio.Future[None]) -> bool:
        link = self._shm.links.get(dst)
        if link is not None and link.withdraw(self._relayed.get(fut, fut)):
            return True
        return super().cancel_send(dst, fut)

    def abort(self) -> None:
        if not self.closed:
            _busy_poll.for_loop(self.loop).remove_source(self._shm)
        super().abort()

    # -- TCP's seam ------------------------------------------------------------------------
    def _peer_connected(self, peer: int) -> None:
        self._shm.connected(peer)

    def _write_data(
        self, proto: _PeerProtocol, key: Key, payload: memoryview, fp: Fingerprint | None
    ) -> asyncio.Future[None]:
        link = self._shm.link_to(proto.peer)
        if link is not None:
            return link.send(key, payload, fp)
        return proto.write_data(key, fp, payload)

    def _before_frame(self, peer: int) -> None:
        # What the peer wrote to shared memory before this frame comes before it.
        self._shm.drain_from(peer)

    def _path_message(self, peer: int, msg: PeerMessage) -> None:
        if type(msg) is ShmFrame:
            self._shm.message(peer, msg.message)

    def _paths_wait(self) -> bool:
        return self._shm.stalled

    def _retry_deferred(self) -> None:
        super()._retry_deferred()
        self._shm.retry()

    def _capped(self) -> list[tuple[int, int]]:
        return super()._capped() + self._shm.capped()

    def _lose(self, proto: _PeerProtocol, err: DistNetworkError, how: _How) -> None:
        if how != "closed":
            self._shm.drain_departed(proto.peer)  # (what it sent first: see ShmPaths.peer_gone)
        super()._lose(proto, err, how)
        self._shm.peer_gone(proto.peer, err)

    def _close_paths(self, exc: DistNetworkError) -> None:
        self._shm.close(exc)

    # -- what the shared-memory paths ask of TCP -------------------------------------------
    def _send_shm_frame(self, dst: int, msg: ShmMessage) -> None:
        proto = self._peers.get(dst)
        # (once leaving, nothing more: the stream is half-closed after our goodbye)
        if proto is None or proto.transport is None or proto.transport.is_closing() or self._closing:
            return
        frame = _BELL_FRAME if isinstance(msg, ShmBell) else encode_message(ShmFrame(msg))
        proto.write_message(frame)

    def _reserve(self, nbytes: int) -> None:
        self._incoming += nbytes

    def _shm_broken(self, peer: int, why: str) -> None:
        proto = self._peers.get(peer)
        if proto is not None:
            proto._poison(ProtocolError(why))
