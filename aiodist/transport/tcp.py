"""TCP transport on the running (uv)loop: one connection per peer pair.

Each connection is an ``asyncio.BufferedProtocol`` driving a sans-IO ``FrameReader``: a
payload whose receive is already posted is read by the kernel straight into the posted
buffer; sends hand the caller's buffer itself to the socket (``writelines`` keeps a
reference, it does not copy), so a send completes only once the socket has taken every
byte (flow control with a zero high-water mark tells us when).

What a send that failed (a timeout, an abandoned collective) leaves behind is never delivered:
messages wait in the connection's own queue, not the socket's, while the socket is full, and
are withdrawn from it; a large payload, handed to the socket by reference, is sent as pending
data, and once the socket has taken its last byte a ``Verdict`` frame follows: delivered (the
send completes then), or withdrawn, if the send failed meanwhile (the receiver drops the message
and its receive waits for the next one; what the caller's buffer held by then does not matter).
A receive that is abandoned while its payload streams in no longer gets the rest: an abandoned
collective's is dropped, a point-to-point message is held for the next receive.

A connection that breaks mid-frame or sends nonsense is poisoned: it is aborted, and the
peer counts as lost; every receive waiting on it fails with ``DistNetworkError`` naming it.

Bounded input: until a connection has authenticated, its reader accepts only small
handshake frames (a 4 KiB scratch buffer, no payloads), and it must finish the handshake
within ``AIODIST_HANDSHAKE_TIMEOUT`` seconds (10 by default); at most
``MAX_PENDING_HANDSHAKES`` strangers are kept at once. Messages that arrive before their
receive is posted are held up to the mailbox's cap (``AIODIST_UNEXPECTED_CAP`` bytes, 1 GiB
by default); a message that would exceed it is not read at all: reading from that peer
pauses until a receive for it is posted (its payload then lands straight in that buffer) or
held messages are consumed. A timeout that happens meanwhile says so.

A peer whose host stops answering (a cut link, a host that lost power: no FIN or RST ever
comes) is lost once its host has acknowledged nothing for ``AIODIST_LINK_TIMEOUT`` seconds
(60 by default; ``link_watch``), and every receive waiting on it fails naming the rank. A
peer that is merely slow or stopped still acknowledges (its kernel does): it is not lost so.

Peers are connected at init (``connect``/``expect``), or on first use: a peer whose address
the transport was given (``dial_on_use``) is connected when something is first sent to it or a
receive from it is posted; what is sent meanwhile waits, in order, for the connection. Two
ranks that dial each other at once keep one connection, the higher rank's: the lower one's is
refused as a crossing at its handshake, before anything was written on it.

This transport knows one path, its sockets. A subclass may add a faster path to some peers
whose signals these connections carry (``shm_tcp``: shared memory between ranks of one host):
it overrides the few methods marked as that seam below.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Literal, cast

from aiodist.errors import DistError, DistNetworkError, DistTimeoutError
from aiodist.settings import Settings
from aiodist.transport.base import DISCARD, Fingerprint, Key, Transport
from aiodist.transport.link_watch import LinkWatch
from aiodist.transport.matching import Discard, Receive
from aiodist.wire.control import Control, Goodbye
from aiodist.wire.frames import PAUSE, SKIP, FrameReader, Limits, ProtocolError, encode_frame
from aiodist.wire.handshake import (
    CROSSING,
    AuthError,
    Challenge,
    Hello,
    Refusal,
    accept_hello,
    make_challenge,
    make_hello,
    make_welcome,
    parse_challenge,
    verify_welcome,
)
from aiodist.wire.messages import (
    Abort,
    Bye,
    ControlFrame,
    Data,
    Mismatch,
    PeerMessage,
    Verdict,
    encode_data,
)
from aiodist.wire.messages import decode as decode_message
from aiodist.wire.messages import encode as encode_message
from aiodist.work import copy_outcome

__all__ = ["TcpTransport"]

log = logging.getLogger("aiodist.transport")

# Payloads up to this size are joined with their header into one bytes object: one small
# copy is cheaper than a second buffer in the write queue.
_SMALL_PAYLOAD = 16 * 1024
MAX_PENDING_HANDSHAKES = 256
PEER_LIMITS = Limits(max_header=64 * 1024, max_payload=1 << 40)
# Before authentication: handshake messages only, no payload, nothing big to decode.
PEER_HANDSHAKE_LIMITS = Limits(
    max_header=2048, max_payload=0, max_str=1024, max_bin=64, max_array=8, max_map=0
)
_HANDSHAKE_SCRATCH = 4096
_EMPTY = memoryview(b"")
_DELIVER = encode_message(Verdict(True))
_WITHDRAW = encode_message(Verdict(False))
_DATA_SCRATCH = 256 * 1024
# How long aclose() waits for peers to close their side after our goodbye.
LEAVE_TIMEOUT = 2.0
# The errors with which the kernel ends a connection whose peer's host stopped answering.
_PATH_LOST = frozenset(
    {errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN}
)

# An unexpected payload this large is not read into a buffer of its own at once: reading from
# its peer pauses for a moment (``_park_delay``) in case its receive is about to be posted (the
# usual case: the sender is one call ahead), so that it lands straight in the receive's buffer
# instead of being allocated, read and copied. Measured: a 2-rank 64 MiB broadcast loop spent
# 42 ms of CPU per call on the receiver that way, 11 ms parked.
_PARK_BYTES = 256 * 1024


def _park_delay(nbytes: int) -> float:
    """How long a large unexpected payload waits unread: about what holding it would cost."""
    return min(0.05, max(0.005, nbytes / 1e9))


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


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
_auth_warning = _RateLimitedWarning()


class _Out:
    """A message in a connection's queue (not handed to the socket yet), or the pending data
    message handed over whose verdict is still to be written."""

    __slots__ = ("future", "header", "key", "payload", "withdrawn")

    def __init__(
        self, header: bytes, payload: memoryview, key: Key | None, future: asyncio.Future[None]
    ) -> None:
        self.header = header
        self.payload = payload
        self.key = key  # (data messages: withdrawn with their operation)
        self.future = future
        self.withdrawn = False


def _settle(fut: asyncio.Future[None] | None) -> None:
    if fut is not None and not fut.done():
        fut.set_result(None)


def _fail(fut: asyncio.Future[Any], exc: BaseException) -> None:
    # (marked retrieved: a failed operation may no longer await its sends)
    if not fut.done():
        fut.set_exception(exc)
        fut.exception()


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
        self._reader = FrameReader(
            self._on_header, self._on_frame, PEER_HANDSHAKE_LIMITS, scratch_size=_HANDSHAKE_SCRATCH
        )
        self._target: Receive | Discard | None = None
        self._reserved = 0  # bytes of an unexpected payload being read (counted against the cap)
        self._deferred_bytes = 0  # size of the message we stopped reading at (0: not paused)
        self._park_timer: asyncio.TimerHandle | None = None  # a large unexpected payload waits
        self._park_expired = False
        self.closed: asyncio.Future[None] = owner.loop.create_future()
        self.refuse = ""  # set by the listener: drop this connection as soon as it is made
        self._key: Key = (0, 0, 0)
        self._fp: Fingerprint | None = None
        self._pending = False  # the payload being read is pending data: a verdict follows
        # A pending data message read whole, waiting for its verdict (the next frame): the
        # receive it fills (a Receive), None (held: its payload), or DISCARD.
        self._undecided: Receive | Discard | None = None
        self._undecided_payload: memoryview | None = None
        self._undecided_at = False  # a message is waiting for its verdict
        # Sending: messages not handed to the socket (it is full), and the pending data message
        # handed over whose verdict waits for the socket to take its last byte.
        self._queue: deque[_Out] = deque()
        self._unsettled: _Out | None = None
        self._paused = False
        self._deadline: asyncio.TimerHandle | None = None
        self.crossed = False  # our dial met the peer's: refused, the peer's connection is kept
        self.departed = False  # the peer said goodbye before closing
        self.silent_for = 0.0  # seconds its host left us unacknowledged, when that ended it
        self.goodbye = Goodbye()  # how it said it leaves

    # -- asyncio callbacks -------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        peername = transport.get_extra_info("peername")
        self.remote = f"{peername[0]}:{peername[1]}" if peername else "?"
        if self.refuse:
            self._poison(ProtocolError(self.refuse))
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Zero watermarks: pause_writing fires whenever bytes are queued, resume_writing once
        # the kernel took them all. That is exactly "every queued buffer may be reused".
        self.transport.set_write_buffer_limits(high=0, low=0)
        self._deadline = self.owner.loop.call_later(self.owner.handshake_timeout, self._handshake_expired)
        if not self.connector:
            self._challenge = make_challenge()
            self.transport.write(encode_frame(self._challenge.pack()))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._reader.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        try:
            self._reader.buffer_updated(nbytes)
        except DistError as exc:
            self._poison(exc)
        except Exception as exc:  # a bug of ours must not leave a half-read stream in use
            log.exception("aiodist: rank %d: internal error reading from %s", self.owner.rank, self.remote)
            self._poison(ProtocolError(f"internal error while reading: {exc!r}"))

    def eof_received(self) -> bool | None:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._release_reservation()
        self._stop_parking()
        self.owner._deferred.discard(self)
        if not self.closed.done():
            self.closed.set_result(None)
        # (the sends still queued fail with what the transport makes of the loss: a peer whose
        # host stopped answering says so, not merely that the connection closed)
        loss = self.owner._loss(self, exc, mid_frame=self._reader.mid_frame)
        lost = loss[0] if loss is not None else self._lost_error(exc)
        for out in self._queue:
            _fail(out.future, lost)
        self._queue.clear()
        if self._unsettled is not None:
            _fail(self._unsettled.future, lost)
            self._unsettled = None
        self._drop_undecided()
        if not self.ready.done():
            self.ready.set_exception(self._lost_error(exc))
            self.ready.exception()  # mark retrieved; the connecting side reports it
        self.owner._connection_lost(self, loss)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        # The socket took every byte handed to it: the pending message's verdict, then what
        # waited in our queue, while the socket takes it.
        self._paused = False
        transport = self.transport
        out = self._unsettled
        if out is not None and transport is not None:
            self._unsettled = None
            transport.write(_WITHDRAW if out.withdrawn else _DELIVER)
            _settle(out.future)  # (a withdrawn one failed when it was withdrawn)
        while self._queue and not self._paused and transport is not None and not transport.is_closing():
            out = self._queue.popleft()
            self._hand_over(out.header, out.payload, out.key, out.future)

    # -- sending ----------------------------------------------------------------------
    def write_message(
        self, header: bytes, payload: memoryview = _EMPTY, key: Key | None = None
    ) -> asyncio.Future[None]:
        """Send one frame (``header``, then ``payload`` for a data message, whose ``key`` is
        given); completes once the socket has it all. Messages keep their order."""
        if self._queue or self._paused:  # behind what the socket has not taken yet
            out = _Out(header, payload, key, self.owner.loop.create_future())
            self._queue.append(out)
            return out.future
        return self._hand_over(header, payload, key, None)

    def write_data(self, key: Key, fp: Fingerprint | None, payload: memoryview) -> asyncio.Future[None]:
        pending = payload.nbytes > _SMALL_PAYLOAD  # (handed over by reference: see _hand_over)
        return self.write_message(encode_data(key, fp, payload.nbytes, pending), payload, key)

    def _hand_over(
        self, header: bytes, payload: memoryview, key: Key | None, fut: asyncio.Future[None] | None
    ) -> asyncio.Future[None]:
        transport = self.transport
        assert transport is not None
        n = payload.nbytes
        if n <= _SMALL_PAYLOAD:
            # Copied with its header: the socket's copy is the message, whole.
            transport.write(header + payload.tobytes() if n else header)
            _settle(fut)
            return self.owner._done
        # By reference: until the socket has taken the last byte, the caller's buffer is the
        # message, and the send may still fail. The verdict follows then (resume_writing).
        transport.writelines((header, payload))
        if not self._paused:
            transport.write(_DELIVER)
            _settle(fut)
            return self.owner._done
        if fut is None:
            fut = self.owner.loop.create_future()
        self._unsettled = _Out(header, payload, key, fut)
        return fut

    def withdraw(self, fut: asyncio.Future[None]) -> bool:
        """Take back the message whose send is ``fut``: True if it will not be delivered (the
        caller fails ``fut``), False if the socket already holds it whole."""
        for out in self._queue:
            if out.future is fut:
                self._queue.remove(out)
                return True
        if self._unsettled is not None and self._unsettled.future is fut:
            self._unsettled.withdrawn = True
            return True
        return False

    def withdraw_key(self, key: Key) -> None:
        """Take back every message of the operation ``key`` not yet whole in the socket.

        (Their sends stay pending: the operation that awaits them is being failed with its own
        error, which a withdrawal must not overtake.)"""
        self._queue = deque(out for out in self._queue if out.key != key)
        last = self._unsettled
        if last is not None and last.key == key:
            last.withdrawn = True

    # -- receiving --------------------------------------------------------------------
    def _on_header(self, header: Any, nbytes: int) -> memoryview | None:
        """Decode a frame's header and hand the message to its handler; where its payload goes."""
        if self.peer < 0:
            if nbytes:
                raise ProtocolError("handshake frame with a payload")
            # The frame ends after the handshake may have completed: mark it as not data.
            self._target = DISCARD
            self._handshake_step(header)
            return None
        try:
            msg = decode_message(header, nbytes)
        except ProtocolError as exc:
            raise ProtocolError(f"{exc} from rank {self.peer}") from None
        self.owner._before_frame(self.peer)
        if self._undecided_at and type(msg) is not Verdict:
            raise ProtocolError(
                f"rank {self.peer} sent {type(msg).__name__} where the verdict on its pending message was due"
            )
        if type(msg) is Data:
            return self._on_data(msg, nbytes)
        self._target = DISCARD  # the other kinds carry no payload
        self._pending = False
        if type(msg) is Verdict:
            self._decide(msg.deliver)
        elif type(msg) is Mismatch:
            self.owner._mismatch_reported(self.peer, msg.key, msg.sent, msg.want)
        elif type(msg) is Abort:
            self.owner._abort_reported(self.peer, msg.key, msg.reason, msg.kind)
        elif type(msg) is Bye:
            self.departed = True
            self.goodbye = msg.goodbye
        elif type(msg) is ControlFrame:
            if not self.owner._closing:
                self.owner._control_received(self.peer, msg.control)
        else:
            self.owner._path_message(self.peer, msg)
        return None

    def _on_data(self, msg: Data, nbytes: int) -> memoryview | None:
        """Match a data message to its receive: its buffer, None (hold it), or PAUSE."""
        owner = self.owner
        key, fp, self._pending = msg
        if owner._closing:
            self._target = DISCARD  # we said goodbye: nothing that arrives matters now
            return cast(memoryview, SKIP)
        target = owner.mailbox.match(self.peer, key, nbytes, fp)
        if target is None and nbytes and not owner._room_for(nbytes):
            # Holding it would exceed the cap: leave it unread until a receive is
            # posted for it or held messages are consumed (backpressure, bounded memory).
            self._deferred_bytes = nbytes
            owner._deferred.add(self)
            if self.transport is not None:
                self.transport.pause_reading()
            return cast(memoryview, PAUSE)
        if target is None and nbytes >= _PARK_BYTES and self._park(nbytes):
            return cast(memoryview, PAUSE)
        if self._park_timer is not None:
            self._stop_parking()
        self._deferred_bytes = 0
        self._target = target
        self._key, self._fp = key, fp
        if target is not None and target is not DISCARD:
            return target.buf
        if target is DISCARD:
            return cast(memoryview, SKIP)
        self._reserved = nbytes
        owner._incoming += nbytes
        return None

    def _on_frame(self, header: Any, payload: memoryview) -> None:
        target, self._target = self._target, None
        if self._pending:  # the receiver's once the verdict (the next frame) says so
            self._pending = False
            self._undecided_at = True
            self._undecided = target
            self._undecided_payload = payload if target is None else None
            return
        if target is DISCARD:
            return
        if target is not None:
            self.owner.mailbox.complete(target, self.peer)
        else:
            self._release_reservation()
            self.owner.mailbox.deliver(self.peer, self._key, self._fp, payload, owned=True)

    def _decide(self, deliver: bool) -> None:
        """The verdict on the pending message read last: deliver it, or drop it (the sender's
        send failed), in which case its receive waits for the next message, first in line."""
        if not self._undecided_at:
            raise ProtocolError(f"rank {self.peer} sent a verdict with no pending message before it")
        target, payload = self._undecided, self._undecided_payload
        self._drop_undecided()
        if target is DISCARD:
            return
        mailbox = self.owner.mailbox
        if target is not None:
            if deliver:
                mailbox.complete(target, self.peer)
            else:
                mailbox.repost(target)
        elif deliver and payload is not None:
            mailbox.deliver(self.peer, self._key, self._fp, payload, owned=True)

    def _drop_undecided(self) -> None:
        if self._undecided_at and self._undecided is None:
            self._release_reservation()  # (a held payload counts until its verdict)
        self._undecided_at = False
        self._undecided = self._undecided_payload = None

    def release_receive(self, fut: asyncio.Future[int]) -> None:
        """The receive ``fut`` was withdrawn (its timeout, a cancellation): a message of this
        peer that it was getting is held for the next receive instead, what arrived of it so
        far included; none of it is written into the receive's buffer from now on."""
        if self.closed.done():
            return  # (the connection is gone: nothing more arrives)
        target = self._target if self._reader.receiving_payload else None
        if target is not None and target is not DISCARD and target.future is fut:
            held = memoryview(bytearray(target.buf.nbytes))
            self._reader.redirect(held)
            self._target = None
            self._reserved = held.nbytes
            self.owner._incoming += held.nbytes
        undecided = self._undecided
        if (
            self._undecided_at
            and undecided is not None
            and undecided is not DISCARD
            and undecided.future is fut
        ):
            self._undecided = None
            self._undecided_payload = memoryview(bytearray(undecided.buf))
            self._reserved = undecided.buf.nbytes
            self.owner._incoming += undecided.buf.nbytes

    def abandon(self, key: Key) -> None:
        """The operation ``key`` was abandoned here: what of its messages is still arriving is
        dropped, and what of ours is not yet whole in the socket is withdrawn."""
        target = self._target
        if self._reader.receiving_payload and self._key == key and target is not DISCARD:
            self._reader.redirect(None)
            self._target = DISCARD
            self._release_reservation()
        if self._undecided_at and self._key == key:
            self._release_reservation()
            self._undecided, self._undecided_payload = DISCARD, None
        self.withdraw_key(key)

    def fail_matched(self, exc: BaseException) -> None:
        """The connection is gone: the receive whose message was arriving (or awaiting its
        verdict) fails too (it is no longer posted, so the mailbox cannot reach it)."""
        for target in (self._target, self._undecided):
            if target is not None and target is not DISCARD:
                _fail(target.future, exc)
        self._target = None
        self._drop_undecided()

    def _park(self, nbytes: int) -> bool:
        """Leave a large unexpected payload unread until its receive is posted, for a moment.

        Returns False when the moment has passed (the payload is then read and held).
        """
        if self._park_expired:
            self._park_expired = False
            return False
        if self._park_timer is None:
            self._park_timer = self.owner.loop.call_later(_park_delay(nbytes), self._park_over)
        self._deferred_bytes = 0  # parked, not held back by the cap
        self.owner._deferred.add(self)
        if self.transport is not None:
            self.transport.pause_reading()
        return True

    def _park_over(self) -> None:
        self._park_timer = None
        self._park_expired = True
        self.owner._deferred.add(self)
        self.owner._schedule_retry()

    def _stop_parking(self) -> None:
        if self._park_timer is not None:
            self._park_timer.cancel()
            self._park_timer = None
        self._park_expired = False

    def _release_reservation(self) -> None:
        if self._reserved:
            self.owner._incoming -= self._reserved
            self._reserved = 0

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
            if msg == Refusal(CROSSING).pack():  # the peer dials us at once: its connection is kept
                self.crossed = True
                self.transport.close()
                return
            welcome = verify_welcome(self._challenge, self._hello, msg, owner.job, owner.secret)
            self._established(welcome.rank)
            return
        assert self._challenge is not None
        try:
            hello = accept_hello(self._challenge, msg, owner.job, owner.secret)
        except AuthError as exc:
            self.transport.write(encode_frame(Refusal(str(exc)).pack()))
            raise
        if owner._crossing(hello.rank):
            self.transport.write(encode_frame(Refusal(CROSSING).pack()))
            self.transport.close()  # (after the refusal: the dialer waits for our connection)
            return
        refusal = owner._check_newcomer(hello.rank)
        if refusal:
            self.transport.write(encode_frame(Refusal(refusal).pack()))
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
        # Authenticated: from the next frame on, data frames with their real limits.
        self._reader.set_limits(PEER_LIMITS, _DATA_SCRATCH)
        self.owner._register(self)
        if not self.ready.done():
            self.ready.set_result(peer)

    def _handshake_expired(self) -> None:
        self._poison(
            ProtocolError(f"no handshake from {self.remote} within {self.owner.handshake_timeout:g} s")
        )

    # -- failure ------------------------------------------------------------------------
    def _poison(self, exc: DistError) -> None:
        """The stream is unusable from here on: drop the connection, never reuse it."""
        if self.peer < 0:
            # Authentication failures are rate-limited apart from garbage, so noise cannot hide them.
            warning = _auth_warning if isinstance(exc, AuthError) else _bad_peer_warning
            warning.warn("aiodist: dropped connection from %s: %s", self.remote, exc)
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


# How a peer went: its connection "closed" by us, "left" in order (a goodbye), or "lost".
_How = Literal["closed", "left", "lost"]

# A message waiting for its peer's connection: writes itself on it (its send's future).
_Write = Callable[[_PeerProtocol], asyncio.Future[None]]


class _Waiting:
    """A message for a peer not connected yet: how it writes itself, its send's future (None:
    not data, nobody waits), and its operation's key (data)."""

    __slots__ = ("future", "key", "write")

    def __init__(self, write: _Write, future: asyncio.Future[None] | None, key: Key | None) -> None:
        self.write = write
        self.future = future
        self.key = key


class TcpTransport(Transport):
    """TCP connections among the ranks of one job, one per pair: made at init or on first use."""

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
        super().__init__(rank, world_size, loop or asyncio.get_running_loop(), settings)
        self.job = job
        self.secret = secret
        self._done: asyncio.Future[None] = self.loop.create_future()
        self._done.set_result(None)
        self._peers: dict[int, _PeerProtocol] = {}
        self._arrivals: dict[int, asyncio.Future[None]] = {}
        # Connected on first use: where such peers listen, the dials under way, and what waits
        # for a dial (in order: each writes itself on the connection once it is up).
        self._dial_book: Callable[[int], tuple[str, int] | None] | None = None
        self._dials: dict[int, asyncio.Task[None]] = {}
        self._on_connect: dict[int, list[_Waiting]] = {}
        self._relayed: dict[asyncio.Future[None], asyncio.Future[None]] = {}
        self._pending_handshakes = 0
        self._server: asyncio.base_events.Server | None = None
        self._poisoned: dict[int, DistError] = {}
        # Connections paused on a message that does not fit under the unexpected cap.
        self._deferred: set[_PeerProtocol] = set()
        self._incoming = 0  # unexpected payload bytes being read right now
        self._retry_scheduled = False
        self._closing = False
        self.handshake_timeout = self.settings.handshake_timeout
        self.link_timeout = self.settings.link_timeout
        self._links = LinkWatch(self.loop, self.link_timeout, self._link_silent)
        self.mailbox.on_drain = self._schedule_retry
        self.mailbox.on_post = self._schedule_retry
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
        if self._pending_handshakes >= MAX_PENDING_HANDSHAKES or self._closing:
            # Too many strangers at once: accept and drop at once rather than let them pile up.
            proto.refuse = f"too many unauthenticated connections (limit {MAX_PENDING_HANDSHAKES})"
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

    # -- peers connected on first use -----------------------------------------------------
    def dial_on_use(self, where: Callable[[int], tuple[str, int] | None]) -> None:
        """Connect the peers not connected yet when first used: ``where(peer)`` says where a
        peer listens (None: nowhere known, and using it fails as it does today)."""
        self._dial_book = where

    def _crossing(self, peer: int) -> bool:
        """A lower rank dials us while we dial it or are connected to it by our own dial: the
        connection the higher rank dialed is the one both keep."""
        return peer < self.rank and (peer in self._dials or peer in self._peers)

    def _dial_soon(self, peer: int) -> None:
        if not self._dialable(peer) or peer in self._peers or peer in self._dials or peer in self.dead_peers:
            return
        task = self.loop.create_task(self._dial(peer))
        self._dials[peer] = task
        task.add_done_callback(lambda _: self._dials.pop(peer, None))

    async def _dial(self, peer: int) -> None:
        assert self._dial_book is not None
        where = self._dial_book(peer)
        if where is None:
            self._dial_failed(
                peer, DistNetworkError(f"rank {self.rank} does not know where rank {peer} listens")
            )
            return
        host, port = where
        made: list[_PeerProtocol] = []

        def protocol() -> _PeerProtocol:
            made.append(_PeerProtocol(self, connector=True))
            return made[0]

        try:
            _, proto = await asyncio.wait_for(
                self.loop.create_connection(protocol, host, port), self.handshake_timeout
            )
            got = await proto.ready
            if got != peer:
                wrong = ProtocolError(f"{host}:{port} answered as rank {got}, not as rank {peer}")
                proto._poison(wrong)
                raise wrong
        except (OSError, TimeoutError, DistError) as exc:
            if peer in self._peers or self.closed:
                return  # (connected the other way meanwhile)
            if made and made[0].crossed:
                await self._await_crossing(peer)
                return
            if isinstance(exc, AuthError):
                why = f"rank {peer} refused this rank ({exc}): set AIODIST_SECRET alike on every rank"
            else:
                why = (
                    f"{exc or type(exc).__name__}: rank {peer} listened there when the job started, "
                    "so it has left or died since, or the network path to it is cut"
                )
            err = DistNetworkError(
                f"rank {self.rank} could not connect to rank {peer} at {host}:{port} when it first "
                f"needed it: {why}"
            )
            err.__cause__ = exc
            self._dial_failed(peer, err)

    async def _await_crossing(self, peer: int) -> None:
        """Our dial met ``peer``'s, which is kept: wait for it (this dial stays under way
        meanwhile, so that what is sent to ``peer`` waits too), bounded, should it never come."""
        arrived = self.expect(peer)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(arrived), self.handshake_timeout)
        if not arrived.done() and not self.closed and peer not in self.dead_peers:
            self._dial_failed(
                peer,
                DistNetworkError(
                    f"rank {peer} refused this rank's connection because it was connecting to this "
                    f"rank, but its connection did not arrive within {self.handshake_timeout:g} s "
                    "(AIODIST_HANDSHAKE_TIMEOUT): it has died since, or the network path from it is cut"
                ),
            )

    def _dial_failed(self, peer: int, err: DistNetworkError) -> None:
        for waiting in self._on_connect.pop(peer, ()):
            if waiting.future is not None:
                _fail(waiting.future, err)
        self._peer_lost(peer, err)

    def _after_dial(
        self, dst: int, write: _Write, fut: asyncio.Future[None] | None, key: Key | None = None
    ) -> None:
        """``write`` the message once ``dst`` is connected (in call order); dial it now."""
        self._on_connect.setdefault(dst, []).append(_Waiting(write, fut, key))
        self._dial_soon(dst)

    def _dialable(self, dst: int) -> bool:
        return (
            self._dial_book is not None
            and not self._closing
            and 0 <= dst < self.world_size
            and dst != self.rank
        )

    def _relay(self, inner: asyncio.Future[None], outer: asyncio.Future[None]) -> None:
        """``outer`` (a send made before its peer was connected) ends as ``inner`` does."""
        if inner.done():
            copy_outcome(outer, inner)
            return
        self._relayed[outer] = inner

        def done(f: asyncio.Future[None]) -> None:
            self._relayed.pop(outer, None)
            copy_outcome(outer, f)

        inner.add_done_callback(done)

    def _register(self, proto: _PeerProtocol) -> None:
        self._peers[proto.peer] = proto
        if proto.transport is not None:
            self._links.add(proto.peer, proto.transport.get_extra_info("socket"))
        self._peer_connected(proto.peer)
        fut = self._arrivals.get(proto.peer)
        if fut is None:
            self._arrivals[proto.peer] = fut = self.loop.create_future()
        if not fut.done():
            fut.set_result(None)
        for waiting in self._on_connect.pop(proto.peer, ()):
            inner = waiting.write(proto)
            if waiting.future is not None:
                self._relay(inner, waiting.future)

    # -- data path ----------------------------------------------------------------------
    def send(
        self, dst: int, key: Key, payload: memoryview, fp: Fingerprint | None = None
    ) -> asyncio.Future[None]:
        proto = self._peers.get(dst)
        self._check_peer(dst, key)
        if proto is None and not self._dialable(dst):
            raise DistNetworkError(f"rank {self.rank} has no connection to rank {dst}")
        if self.mailbox.was_abandoned(key):
            # (an operation abandoned here, still running until it is failed: nothing more of
            # it leaves this rank, and its send stays pending until then)
            return self.loop.create_future()
        if proto is None:
            fut: asyncio.Future[None] = self.loop.create_future()
            self._after_dial(dst, lambda p: self._write_data(p, key, payload, fp), fut, key)
            return fut
        return self._write_data(proto, key, payload, fp)

    def recv(
        self, src: int | None, key: Key, buf: memoryview, fp: Fingerprint | None = None
    ) -> asyncio.Future[int]:
        if src is not None and self._dial_book is not None and src not in self._peers:
            self._dial_soon(src)  # (so that its loss, should it die first, fails this receive)
        return self.mailbox.post(src, key, buf, fp)

    def _send_frame(self, dst: int, frame: bytes, *, dial: bool) -> None:
        """Send a frame other than data (best effort: nothing once ``dst`` is gone or we leave).

        To a peer not connected yet it waits for a dial under way, and starts one only if
        ``dial``: an abort or a mismatch report concerns a peer that is connected (one that
        waits for us dialed us), and once the job lost a peer nothing but data opens a new
        connection into what may be a broken network (leaving would wait for it).
        """
        if dst in self.dead_peers or self._closing:
            return
        proto = self._peers.get(dst)
        if proto is None:
            if dst in self._dials or (dial and self.first_loss is None and self._dialable(dst)):
                self._after_dial(dst, lambda p: p.write_message(frame), None)
            return
        # (once leaving, say nothing more: the goodbye tells the peers; the stream is half-closed)
        if proto.transport is not None and not proto.transport.is_closing():
            proto.write_message(frame)

    def _send_mismatch(self, dst: int, key: Key, sent: Fingerprint | None, want: Fingerprint | None) -> None:
        self._send_frame(dst, encode_message(Mismatch(key, sent, want)), dial=False)

    def send_abort(self, dst: int, key: Key, reason: str, kind: str = "network") -> None:
        self._send_frame(dst, encode_message(Abort(key, reason, kind)), dial=False)

    def send_control(self, dst: int, msg: Control) -> None:
        self._send_frame(dst, encode_message(ControlFrame(msg)), dial=True)

    # -- the seam for another path (see the module docstring): what a subclass overrides ----
    def _peer_connected(self, peer: int) -> None:
        """The handshake with ``peer`` completed (before anybody waiting for it hears so)."""

    def _write_data(
        self, proto: _PeerProtocol, key: Key, payload: memoryview, fp: Fingerprint | None
    ) -> asyncio.Future[None]:
        """Send a data message to ``proto``'s peer, on its connection here."""
        return proto.write_data(key, fp, payload)

    def _before_frame(self, peer: int) -> None:
        """A frame of ``peer`` is about to be handled: what it sent by another path first comes
        first."""

    def _path_message(self, peer: int, msg: PeerMessage) -> None:
        """A message of another path that ``peer``'s connection carried (none here: ignored)."""

    def _paths_wait(self) -> bool:
        """Does another path wait for a receive to be posted or for room under the cap?"""
        return False

    def _capped(self) -> list[tuple[int, int]]:
        """(peer, bytes needed) of the peers whose next message waits for room under the cap."""
        # (not those merely parked: they wait a moment for their receive, not for room)
        return [(p.peer, p._deferred_bytes) for p in self._deferred if p._deferred_bytes]

    def _close_paths(self, exc: DistNetworkError) -> None:
        """The transport is closing: fail what another path still holds with ``exc``."""

    # -- backpressure -------------------------------------------------------------------
    def _room_for(self, nbytes: int) -> bool:
        """May an unexpected message of ``nbytes`` be read and held now?"""
        mailbox = self.mailbox
        return mailbox.unexpected_bytes + self._incoming + nbytes <= mailbox.unexpected_cap

    def _schedule_retry(self) -> None:
        if (self._deferred or self._paths_wait()) and not self._retry_scheduled:
            self._retry_scheduled = True
            self.loop.call_soon(self._retry_deferred)

    def _retry_deferred(self) -> None:
        """A receive was posted or held memory freed: look again at the paused messages."""
        self._retry_scheduled = False
        for proto in list(self._deferred):
            self._deferred.discard(proto)
            transport = proto.transport
            if transport is None or transport.is_closing():
                continue
            try:
                resumed = proto._reader.resume()
            except DistError as exc:
                proto._poison(exc)
                continue
            if resumed:
                transport.resume_reading()

    def abandon(self, key: Key) -> None:
        super().abandon(key)
        for proto in self._peers.values():
            proto.abandon(key)
        for dst, queue in self._on_connect.items():
            # (their sends stay pending, as withdraw_key's: the operation fails with its own error)
            self._on_connect[dst] = [w for w in queue if w.key != key]
        self._schedule_retry()  # a paused message may belong to the abandoned operation

    def cancel_recv(self, fut: asyncio.Future[int]) -> None:
        super().cancel_recv(fut)
        for proto in self._peers.values():
            proto.release_receive(fut)

    def cancel_send(self, dst: int, fut: asyncio.Future[None]) -> bool:
        waiting = self._on_connect.get(dst, [])
        for i, queued in enumerate(waiting):
            if queued.future is fut:  # (still waiting for its peer's connection: never written)
                del waiting[i]
                return True
        fut = self._relayed.pop(fut, fut)
        proto = self._peers.get(dst)
        return proto is not None and proto.withdraw(fut)

    def stall_note(self) -> str:
        capped = self._capped()
        if not capped:
            return ""
        ranks = sorted({peer for peer, _ in capped})
        biggest = max(need for _, need in capped)
        held = self.mailbox.unexpected_bytes + self._incoming
        return (
            f"; reading from rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} is paused: "
            f"messages that arrived before their receives were posted hold {_fmt_bytes(held)} of the "
            f"{_fmt_bytes(self.mailbox.unexpected_cap)} cap (AIODIST_UNEXPECTED_CAP) and the next one "
            f"needs {_fmt_bytes(biggest)}"
        )

    # -- failure ----------------------------------------------------------------------
    def _link_silent(self, peer: int, seconds: float) -> None:
        """``peer``'s host has acknowledged nothing for ``seconds`` (``LinkWatch``): drop it."""
        proto = self._peers.get(peer)
        if proto is not None and proto.transport is not None:
            proto.silent_for = seconds
            proto.transport.abort()

    def _connection_lost(self, proto: _PeerProtocol, loss: tuple[DistNetworkError, _How] | None) -> None:
        if loss is None:
            return
        del self._peers[proto.peer]
        self._links.remove(proto.peer)
        self._lose(proto, *loss)

    def _loss(
        self, proto: _PeerProtocol, exc: Exception | None, *, mid_frame: bool
    ) -> tuple[DistNetworkError, _How] | None:
        """What the end of ``proto``'s connection means, and how its peer went ("closed" by us,
        "left" in order, "lost"; see ``_lose``); None for a connection not (or no longer) a peer's."""
        if proto.peer < 0 or self._peers.get(proto.peer) is not proto:
            return None
        if self.closed or self._closing:
            return DistNetworkError(f"rank {self.rank}: transport closed"), "closed"
        cause = self._poisoned.get(proto.peer)
        if proto.departed and cause is None:
            # An orderly leave: fail what still needs this rank, but do not break the groups;
            # the other ranks may go on among themselves (torch's tutorial programs do).
            return DistNetworkError(proto.goodbye.describe(proto.peer)), "left"
        if cause is not None:
            err = DistNetworkError(f"connection to rank {proto.peer} was dropped: {cause}")
        elif proto.silent_for or (isinstance(exc, OSError) and exc.errno in _PATH_LOST):
            # (a cut link, a host that lost power: no FIN or RST ever came)
            if proto.silent_for:
                limit = f"for {proto.silent_for:.1f} s (AIODIST_LINK_TIMEOUT is {self.link_timeout:g} s)"
            elif self.link_timeout > 0:
                limit = f"for about {self.link_timeout:g} s (AIODIST_LINK_TIMEOUT)"
            else:
                limit = "until the kernel gave up on it"
            err = DistNetworkError(
                f"rank {proto.peer} stopped answering: its host acknowledged nothing {limit}; the "
                "network path to it is cut, or its host is down" + (f" ({exc})" if exc else "")
            )
        else:
            how = " in the middle of a frame" if mid_frame else ""
            err = DistNetworkError(
                f"rank {proto.peer} closed its connection{how} without saying goodbye: the process died "
                "(killed or crashed, or it ended without leaving the job)" + (f" ({exc})" if exc else "")
            )
        err.__cause__ = cause or exc
        return err, "lost"

    def _lose(self, proto: _PeerProtocol, err: DistNetworkError, how: _How) -> None:
        """``proto``'s peer is gone (``how``: "closed" by us, "left" in order, or "lost"): fail
        what waits on it; a lost peer's groups fail their operations with ``err``, naming it."""
        if how == "left":
            self._peer_left(proto.peer, err)
        elif how == "lost":
            self._peer_lost(proto.peer, err)
        proto.fail_matched(err)

    # -- lifetime -----------------------------------------------------------------------
    async def aclose(self) -> None:
        if self.closed:
            return
        # Say goodbye (so peers know this is a leave, not a crash), let queued sends reach
        # the kernel (bounded), then half-close and wait (briefly) for every peer to close
        # its side: a socket closed with unread bytes is reset by the kernel, which would
        # drop what we sent last. Whatever arrives meanwhile is discarded.
        # Data sent to a peer whose connection is under way leaves before we do (bounded).
        carrying = [
            dial
            for peer, dial in self._dials.items()
            if any(w.future is not None for w in self._on_connect.get(peer, ()))
        ]
        if carrying:
            await asyncio.wait(carrying, timeout=self.handshake_timeout)
        self._closing = True
        self._schedule_retry()
        protos = [p for p in self._peers.values() if p.transport is not None and not p.transport.is_closing()]
        # Say how we leave and, if a lost peer is why, say so: our peers' errors then name the
        # root cause.
        how = self.goodbye or Goodbye()
        if self.first_loss is not None and not how.after_loss:
            how = Goodbye(how.how, how.detail, str(self.first_loss)[:2000])
        bye = encode_message(Bye(how))
        waits = [p.write_message(bye) for p in protos]
        pending = [w for w in waits if isinstance(w, asyncio.Future) and not w.done()]
        if pending:
            await asyncio.wait(pending, timeout=5.0)
        closers: list[asyncio.Future[None]] = []
        for p in protos:
            if p.transport is not None and not p.transport.is_closing():
                with contextlib.suppress(Exception):
                    p.transport.write_eof()
                    closers.append(p.closed)
        if closers:
            await asyncio.wait(closers, timeout=LEAVE_TIMEOUT)
        self.abort()

    def abort(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._server is not None:
            self._server.close()
        exc = DistNetworkError(f"rank {self.rank}: transport closed")
        self._links.close()
        self._close_paths(exc)
        for dial in self._dials.values():
            dial.cancel()
        for queue in self._on_connect.values():
            for waiting in queue:
                if waiting.future is not None:
                    _fail(waiting.future, exc)
        self._on_connect.clear()
        self.mailbox.fail_all(exc)
        for proto in list(self._peers.values()):
            if proto.transport is not None:
                proto.transport.abort()
        self._peers.clear()
