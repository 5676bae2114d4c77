"""TCP transport on the running (uv)loop: one connection per peer pair.

Each connection is an ``asyncio.BufferedProtocol`` driving a sans-IO ``FrameReader``: a
payload whose receive is already posted is read by the kernel straight into the posted
buffer; sends hand the caller's buffer itself to the socket (``writelines`` keeps a
reference, it does not copy), so a send completes only once the socket has taken every
byte queued so far (flow control with a zero high-water mark tells us when).

A connection that breaks mid-frame or sends nonsense is poisoned: it is aborted, and the
peer counts as lost; every receive waiting on it fails with ``DistNetworkError`` naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import deque
from collections.abc import Awaitable
from typing import Any, cast

from aiodist.errors import DistError, DistNetworkError, DistTimeoutError
from aiodist.transport.base import DISCARD, Fingerprint, Key, PendingRecv, Transport
from aiodist.wire.frames import FrameReader, Limits, ProtocolError, encode_frame
from aiodist.wire.handshake import (
    AuthError,
    Challenge,
    Hello,
    accept_hello,
    make_challenge,
    make_hello,
    make_welcome,
    parse_challenge,
    verify_welcome,
)

__all__ = ["TcpTransport"]

log = logging.getLogger("aiodist.transport")

KIND_DATA = 0
KIND_MISMATCH = 1
KIND_ABORT = 2
KIND_BYE = 3  # an orderly goodbye: the peer destroyed its process group and is leaving

# Payloads up to this size are joined with their header into one bytes object: one small
# copy is cheaper than a second buffer in the write queue.
_SMALL_PAYLOAD = 16 * 1024
HANDSHAKE_TIMEOUT = 10.0
MAX_PENDING_HANDSHAKES = 256
PEER_LIMITS = Limits(max_header=64 * 1024, max_payload=1 << 40)


class _RateLimitedWarning:
    """At most one warning per ``interval`` seconds, so garbage on a port cannot flood the log."""

    def __init__(self, interval: float = 5.0) -> None:
        self.interval = interval
        self._last = 0.0
        self._suppressed = 0

    def warn(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last < self.interval:
            self._suppressed += 1
            return
        extra = f" ({self._suppressed} similar suppressed)" if self._suppressed else ""
        self._last, self._suppressed = now, 0
        log.warning(msg + extra, *args)


_bad_peer_warning = _RateLimitedWarning()


class _PeerProtocol(asyncio.BufferedProtocol):
    """One connection to one peer: handshake first, then data frames."""

    def __init__(self, owner: TcpTransport, *, connector: bool) -> None:
        self.owner = owner
        self.connector = connector
        self.peer: int = -1
        self.transport: asyncio.Transport | None = None
        self.remote = "?"
        self.ready: asyncio.Future[int] = owner.loop.create_future()
        self._challenge: Challenge | None = None
        self._hello: Hello | None = None
        self._reader = FrameReader(self._on_header, self._on_frame, PEER_LIMITS)
        self._target: PendingRecv | object | None = None
        self._key: Key = (0, 0, 0)
        self._fp: Fingerprint | None = None
        self._drain_waiters: deque[asyncio.Future[None]] = deque()
        self._paused = False
        self._deadline: asyncio.TimerHandle | None = None
        self.departed = False  # the peer said goodbye before closing

    # -- asyncio callbacks -------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        peername = transport.get_extra_info("peername")
        self.remote = f"{peername[0]}:{peername[1]}" if peername else "?"
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Zero watermarks: pause_writing fires whenever bytes are queued, resume_writing once
        # the kernel took them all. That is exactly "every queued buffer may be reused".
        self.transport.set_write_buffer_limits(high=0, low=0)
        self._deadline = self.owner.loop.call_later(HANDSHAKE_TIMEOUT, self._handshake_expired)
        if not self.connector:
            self._challenge = make_challenge()
            self.transport.write(encode_frame(self._challenge.pack()))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._reader.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        try:
            self._reader.buffer_updated(nbytes)
        except ProtocolError as exc:
            self._poison(exc)
        except DistError as exc:
            self._poison(exc)

    def eof_received(self) -> bool | None:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        for fut in self._drain_waiters:
            if not fut.done():
                fut.set_exception(self._lost_error(exc))
        self._drain_waiters.clear()
        if not self.ready.done():
            self.ready.set_exception(self._lost_error(exc))
            self.ready.exception()  # mark retrieved; the connecting side reports it
        self.owner._connection_lost(self, exc, mid_frame=self._reader.mid_frame)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        waiters, self._drain_waiters = self._drain_waiters, deque()
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    # -- sending ----------------------------------------------------------------------
    def write_message(self, header: bytes, payload: memoryview) -> Awaitable[None]:
        transport = self.transport
        assert transport is not None
        if payload.nbytes <= _SMALL_PAYLOAD:
            transport.write(header + payload.tobytes() if payload.nbytes else header)
        else:
            transport.writelines((header, payload))
        if not self._paused:
            return self.owner._done
        fut = self.owner.loop.create_future()
        self._drain_waiters.append(fut)
        return fut

    # -- receiving --------------------------------------------------------------------
    def _on_header(self, header: Any, nbytes: int) -> memoryview | None:
        if self.peer < 0:
            if nbytes:
                raise ProtocolError("handshake frame with a payload")
            # The frame ends after the handshake may have completed: mark it as not data.
            self._target = DISCARD
            self._handshake_step(header)
            return None
        try:
            kind, gid, chan, n, fp = header
        except (TypeError, ValueError):
            raise ProtocolError(f"malformed message header from rank {self.peer}") from None
        if kind == KIND_DATA:
            key = (gid, chan, n)
            target = self.owner.mailbox.match(self.peer, key, nbytes, fp)
            self._target = target
            if isinstance(target, PendingRecv):
                return target.buf
            self._key, self._fp = key, fp
            return None
        if kind == KIND_MISMATCH:
            if nbytes or not isinstance(fp, list) or len(fp) != 2:
                raise ProtocolError(f"malformed mismatch report from rank {self.peer}")
            self.owner._mismatch_reported(self.peer, (gid, chan, n), fp[0], fp[1])
            self._target = DISCARD
            return None
        if kind == KIND_ABORT:
            if nbytes or not isinstance(fp, str):
                raise ProtocolError(f"malformed abort notice from rank {self.peer}")
            self.owner._abort_reported(self.peer, (gid, chan, n), fp)
            self._target = DISCARD
            return None
        if kind == KIND_BYE:
            self.departed = True
            self._target = DISCARD
            return None
        raise ProtocolError(f"unknown message kind {kind!r} from rank {self.peer}")

    def _on_frame(self, header: Any, payload: memoryview) -> None:
        target, self._target = self._target, None
        if target is DISCARD:
            return
        if isinstance(target, PendingRecv):
            self.owner.mailbox.complete(target, self.peer)
        elif target is None:
            mailbox = self.owner.mailbox
            mailbox.deliver(self.peer, self._key, self._fp, payload, owned=True)
            if mailbox.over_cap and self.transport is not None:
                # Backpressure: stop reading until receives consume what is held.
                self.transport.pause_reading()
                self.owner._paused_readers.add(self)

    # -- handshake ----------------------------------------------------------------------
    def _handshake_step(self, msg: Any) -> None:
        owner = self.owner
        assert self.transport is not None
        if self.connector:
            if self._challenge is None:
                self._challenge = parse_challenge(msg)
                self._hello = make_hello(self._challenge, owner.job, owner.rank, owner.secret)
                self.transport.write(encode_frame(self._hello.pack()))
                return
            assert self._hello is not None
            welcome = verify_welcome(self._challenge, self._hello, msg, owner.job, owner.secret)
            self._established(welcome.rank)
            return
        assert self._challenge is not None
        try:
            hello = accept_hello(self._challenge, msg, owner.job, owner.secret)
        except AuthError as exc:
            self.transport.write(encode_frame(["refused", str(exc)]))
            raise
        refusal = owner._check_newcomer(hello.rank)
        if refusal:
            self.transport.write(encode_frame(["refused", refusal]))
            raise AuthError(refusal)
        self.transport.write(
            encode_frame(make_welcome(self._challenge, hello, owner.job, owner.rank, owner.secret).pack())
        )
        self._established(hello.rank)

    def _established(self, peer: int) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self.peer = peer
        self.owner._register(self)
        if not self.ready.done():
            self.ready.set_result(peer)

    def _handshake_expired(self) -> None:
        self._poison(ProtocolError(f"no handshake from {self.remote} within {HANDSHAKE_TIMEOUT:.0f} s"))

    # -- failure ------------------------------------------------------------------------
    def _poison(self, exc: DistError) -> None:
        """The stream is unusable from here on: drop the connection, never reuse it."""
        if self.peer < 0:
            _bad_peer_warning.warn("aiodist: dropped connection from %s: %s", self.remote, exc)
        else:
            log.error("aiodist: rank %d: connection to rank %d poisoned: %s", self.owner.rank, self.peer, exc)
            self.owner._poisoned[self.peer] = exc
        if not self.ready.done():
            self.ready.set_exception(exc)
            self.ready.exception()
        if self.transport is not None:
            self.transport.abort()

    def _lost_error(self, exc: Exception | None) -> DistNetworkError:
        who = f"rank {self.peer}" if self.peer >= 0 else f"peer at {self.remote}"
        return DistNetworkError(f"{who} closed its connection" + (f" ({exc})" if exc else ""))


class TcpTransport(Transport):
    """Full mesh of TCP connections among the ranks of one job."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        job: str,
        secret: bytes | None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(rank, world_size, loop or asyncio.get_running_loop())
        self.job = job
        self.secret = secret
        self._done: asyncio.Future[None] = self.loop.create_future()
        self._done.set_result(None)
        self._peers: dict[int, _PeerProtocol] = {}
        self._arrivals: dict[int, asyncio.Future[None]] = {}
        self._pending_handshakes = 0
        self._server: asyncio.base_events.Server | None = None
        self._paused_readers: set[_PeerProtocol] = set()
        self._poisoned: dict[int, DistError] = {}
        self.mailbox.on_drain = self._resume_readers
        self.port = 0

    # -- setup ------------------------------------------------------------------------
    async def listen(self, host: str, port: int = 0) -> int:
        """Start accepting peers on ``host``; returns the bound port."""
        self._server = await self.loop.create_server(
            self._accept, host, port, reuse_address=True, backlog=1024
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def _accept(self) -> _PeerProtocol:
        proto = _PeerProtocol(self, connector=False)
        if self._pending_handshakes >= MAX_PENDING_HANDSHAKES:
            # Too many strangers at once: accept and drop at once rather than let them pile up.
            self.loop.call_soon(proto._poison, ProtocolError("too many unauthenticated connections"))
        self._pending_handshakes += 1
        proto.ready.add_done_callback(self._handshake_done)
        return proto

    def _handshake_done(self, fut: asyncio.Future[int]) -> None:
        self._pending_handshakes -= 1

    def expect(self, peer: int) -> asyncio.Future[None]:
        """A future set when ``peer`` has connected to us (or we to it)."""
        if peer not in self._arrivals:
            self._arrivals[peer] = self.loop.create_future()
            if peer in self._peers:
                self._arrivals[peer].set_result(None)
        return self._arrivals[peer]

    async def connect(self, peer: int, host: str, port: int, timeout: float) -> None:
        """Connect to ``peer`` at host:port, retrying while it is not listening yet."""
        deadline = self.loop.time() + timeout
        delay = 0.01
        last: BaseException | None = None
        while True:
            try:
                _, proto = await asyncio.wait_for(
                    self.loop.create_connection(lambda: _PeerProtocol(self, connector=True), host, port),
                    max(0.01, deadline - self.loop.time()),
                )
                got = await asyncio.wait_for(proto.ready, max(0.01, deadline - self.loop.time()))
                if got != peer:
                    raise DistNetworkError(
                        f"rank {self.rank}: {host}:{port} answered as rank {got}, expected rank {peer}"
                    )
                return
            except (OSError, TimeoutError) as exc:
                last = exc
            if self.loop.time() + delay >= deadline:
                raise DistTimeoutError(
                    f"rank {self.rank} could not connect to rank {peer} at {host}:{port} within {timeout:.1f} s: {last}"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _check_newcomer(self, peer: int) -> str | None:
        if not 0 <= peer < self.world_size or peer == self.rank:
            return f"rank {peer} is not a peer of rank {self.rank} in a world of {self.world_size}"
        if peer in self._peers:
            return f"rank {peer} is already connected to rank {self.rank} (two processes claim rank {peer})"
        return None

    def _register(self, proto: _PeerProtocol) -> None:
        self._peers[proto.peer] = proto
        fut = self._arrivals.get(proto.peer)
        if fut is None:
            self._arrivals[proto.peer] = fut = self.loop.create_future()
        if not fut.done():
            fut.set_result(None)

    # -- data path ----------------------------------------------------------------------
    def send(self, dst: int, key: Key, payload: memoryview, fp: Fingerprint | None = None) -> Awaitable[None]:
        proto = self._peers.get(dst)
        if proto is None:
            self.check_peer(dst)
            raise DistNetworkError(f"rank {self.rank} has no connection to rank {dst}")
        if dst in self.dead_peers:
            raise self.dead_peers[dst]
        return proto.write_message(
            encode_frame([KIND_DATA, key[0], key[1], key[2], fp], payload.nbytes), payload
        )

    def _send_mismatch(self, dst: int, key: Key, sent: Fingerprint | None, want: Fingerprint | None) -> None:
        proto = self._peers.get(dst)
        if proto is not None and dst not in self.dead_peers:
            proto.write_message(
                encode_frame([KIND_MISMATCH, key[0], key[1], key[2], [sent, want]]), memoryview(b"")
            )

    def send_abort(self, dst: int, key: Key, reason: str) -> None:
        proto = self._peers.get(dst)
        if proto is not None and dst not in self.dead_peers and proto.transport is not None:
            proto.write_message(
                encode_frame([KIND_ABORT, key[0], key[1], key[2], reason[:4000]]), memoryview(b"")
            )

    def _resume_readers(self) -> None:
        for proto in self._paused_readers:
            if proto.transport is not None and not proto.transport.is_closing():
                proto.transport.resume_reading()
        self._paused_readers.clear()

    # -- failure ----------------------------------------------------------------------
    def _connection_lost(self, proto: _PeerProtocol, exc: Exception | None, *, mid_frame: bool) -> None:
        self._paused_readers.discard(proto)
        if proto.peer < 0 or self._peers.get(proto.peer) is not proto:
            return
        del self._peers[proto.peer]
        if self.closed:
            return
        cause = self._poisoned.get(proto.peer)
        if proto.departed and cause is None:
            # An orderly leave: fail what still needs this rank, but do not break the groups;
            # the other ranks may go on among themselves (torch's tutorial programs do).
            self._peer_left(
                proto.peer, DistNetworkError(f"rank {proto.peer} has left the job (destroy_process_group)")
            )
            return
        if cause is not None:
            err = DistNetworkError(f"connection to rank {proto.peer} was dropped: {cause}")
        else:
            how = " in the middle of a frame" if mid_frame else ""
            err = DistNetworkError(
                f"rank {proto.peer} closed its connection{how}" + (f" ({exc})" if exc else "")
            )
        err.__cause__ = cause or exc
        self._peer_lost(proto.peer, err)

    # -- lifetime -----------------------------------------------------------------------
    async def aclose(self) -> None:
        if self.closed:
            return
        # Say goodbye (so peers know this is a leave, not a crash), let queued sends reach
        # the kernel (bounded), then close.
        bye = encode_frame([KIND_BYE, 0, 0, 0, None])
        waits = [p.write_message(bye, memoryview(b"")) for p in self._peers.values() if p.transport is not None]
        pending = [w for w in waits if isinstance(w, asyncio.Future) and not w.done()]
        if pending:
            await asyncio.wait(pending, timeout=5.0)
        self.abort()

    def abort(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._server is not None:
            self._server.close()
        exc = DistNetworkError(f"rank {self.rank}: transport closed")
        self.mailbox.fail_all(exc)
        for proto in list(self._peers.values()):
            if proto.transport is not None:
                proto.transport.abort()
        self._peers.clear()
