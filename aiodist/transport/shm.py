"""Shared memory between ranks on one host: the data messages of a TCP transport's local peers.

``ShmPaths`` belongs to one ``ShmTcpTransport`` (``shm_tcp``). After a peer's handshake both
ends say which host they are on (``ShmHello``); between ranks of one host each creates a
segment for the direction it writes (``shm_segment``), offers its name over the authenticated
connection, the reader maps it, proves it sees the same memory (the nonce, and an echo the
creator checks) and tries a single-copy read of the creator's memory; then the creator unlinks
the name and says ``ShmStart`` on TCP, after which its data messages for that peer go through
the segment. Any failure leaves that direction on TCP (logged at debug level). TCP keeps the
handshake, control, aborts, mismatch reports and goodbyes, and carries the doorbells.

A ``_Link`` is one peer: the ring this rank writes (``out``) and the one it reads (``inp``).
Messages are records of the ring, matched by the transport's mailbox exactly as TCP frames
(same key, size and fingerprint checks):

* up to ``EAGER`` bytes (``EAGER_SHARED_CORES`` where ranks share cores; everything when
  single-copy reads are refused): the payload is copied into the ring (pieces of ``PIECE``
  bytes for big ones; two copies); a record over ``HOLD_AT_ONCE`` bytes whose receive is not
  posted waits in the ring for it a few ms before it is held (``_park``);
* larger: a descriptor (pid, address, size); the reader copies the bytes straight from the
  writer's buffer into the posted receive's (``process_vm_readv``, one copy, ``CMA_CHUNK`` at a
  time with a turn of the loop between) and counts it done in the writer's segment, which is
  when the writer's send completes (its buffer stays untouched until then).

A send that fails (a timeout, an abandoned collective) leaves nothing that could be delivered:
its records not yet written are taken out of the writer's queue; a message half written in
pieces ends with a ``DROP`` record instead of its last pieces; a descriptor is withdrawn by the
handshake described in ``shm_segment`` (the reader drops it unless it had claimed it first, and
then the send completes). A receive abandoned while its message arrives in pieces or by a
single-copy read gets none of the rest: an abandoned collective's is dropped, a point-to-point
message is held for the next receive. A dropped message's receive waits for the next one.

Doorbells: a writer sends a ``ShmBell`` on TCP after writing unless the reader's loop polls
(its flag in its own segment, set while ``aiodist.runtime.busy_poll`` keeps the loop spinning).
A skipped doorbell is checked again after ``RECHECK`` seconds: the reader may have stopped
polling just as the record landed (store-load reordering), and then gets its doorbell late.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import os
import socket
from collections import deque
from collections.abc import Callable
from typing import Any

import msgpack

from aiodist.errors import DistNetworkError
from aiodist.runtime import host as _host
from aiodist.settings import Settings
from aiodist.transport.base import DISCARD, Fingerprint, Key
from aiodist.transport.matching import Matcher, Receive
from aiodist.transport.shm_eager import EagerReader, EagerWriter, reader_for, writer_for
from aiodist.transport.shm_segment import (
    DESC_SLOTS,
    ECHO,
    SKIP_BELLS,
    TSO,
    W_ACKED,
    W_BLOCKED,
    W_POLLING,
    W_SEEN,
    W_VERDICT,
    W_WITHDRAWN,
    Doorbell,
    Rings,
    Segment,
    address_of,
    cma_read,
    fence,
    ring_type,
    unlink_name,
)
from aiodist.wire.frames import DEFAULT_LIMITS, ProtocolError, decode_header
from aiodist.wire.shm import (
    BIN_DATA,
    BIN_TAG,
    DATA,
    DESC,
    DROP,
    MORE,
    PART,
    SHAPE,
    ShapeReader,
    ShapeWriter,
    ShmAccept,
    ShmBell,
    ShmDecline,
    ShmHello,
    ShmMessage,
    ShmOffer,
    ShmStart,
    decode_record_header,
)

__all__ = ["ShmPaths"]

log = logging.getLogger("aiodist.transport")

# Up to EAGER bytes a message is one record of the ring (two copies): a memcpy of a buffer the
# caches hold is three to five times faster than a single-copy read, which pins the writer's
# pages one by one (this machine: 1 MiB in 23 us against 85 us; 8 MiB in 230 against 460). Larger
# messages go by descriptor, or in pieces of PIECE bytes where single-copy reads are refused.
# Two copies trade CPU for latency: where ranks share cores (more local ranks than cores) the
# CPU is what runs out, and only messages up to EAGER_SHARED_CORES go eagerly (4 ranks on 2
# cores, 64 MiB all_reduce in 1 MiB segments: 0.81 GB/s eager against 1.11 single-copy).
EAGER = 1024 * 1024
EAGER_SHARED_CORES = 64 * 1024
PIECE = 1024 * 1024
# A record larger than this that finds no receive posted waits in the ring for one (briefly,
# see _park) rather than being copied into fresh memory: a sender running ahead (a broadcast's
# root) is then held back by the ring's room, and the reader faults in no new pages per message.
HOLD_AT_ONCE = 64 * 1024
CMA_CHUNK = 8 * 1024 * 1024  # a single-copy read turns the loop over after each chunk
RECHECK = 0.001  # seconds before a skipped doorbell is looked at again
VERDICT_POLL = 0.0005  # seconds between looks for the writer's verdict on a withdrawn descriptor
ROOM_RETRY = 0.0005  # seconds between looks for room in a full ring (also nudged by doorbells)
SETUP_TIMEOUT = 5.0

_OFF, _PENDING, _ON = 0, 1, 2


def job_token(job: str, named: str) -> str:
    """The job part of segment names: ``named`` (``AIODIST_SHM_JOB``, set by the launcher, which
    sweeps what its workers leave), else a hash of the transport's job id."""
    return named or hashlib.sha256(job.encode()).hexdigest()[:12]


class _Send:
    """A message not yet (wholly) in the ring, or a descriptor awaiting the reader's claim."""

    __slots__ = ("desc", "fp", "future", "key", "kind", "offset", "payload", "withdrawn")

    def __init__(
        self, kind: int, key: Key, fp: Fingerprint | None, payload: memoryview, future: asyncio.Future[None]
    ) -> None:
        self.kind = kind
        self.key = key
        self.fp = fp
        self.payload = payload
        self.offset = 0
        self.future = future
        self.desc = -1  # a descriptor's number on its ring
        self.withdrawn = False  # (a descriptor taken back: its claim, if one comes, is ignored)


class _Part:
    """A message arriving in pieces: where they go (None: dropped) and how far it got."""

    __slots__ = ("buf", "fp", "held", "key", "offset", "recv", "total")

    def __init__(
        self,
        key: Key,
        fp: Fingerprint | None,
        total: int,
        buf: memoryview | None,
        recv: Receive | None,
        *,
        held: bool,
    ) -> None:
        self.key = key
        self.fp = fp
        self.total = total
        self.buf = buf
        self.recv = recv
        self.held = held
        self.offset = 0


class _Link:
    """Shared memory with one peer: the ring this rank writes and the one it reads."""

    def __init__(self, paths: ShmPaths, peer: int) -> None:
        self.paths = paths
        self.peer = peer
        self.peer_pid = 0  # the process whose memory single-copy reads may read (from its offer)
        self.out_state = _PENDING
        self.in_state = _PENDING
        self.out_seg: Segment | None = None
        self.out: Rings | None = None
        self.shapes_out = ShapeWriter(paths.packb)  # (the fingerprint shapes numbered in ``out``)
        self.in_seg: Segment | None = None
        self.inp: Rings | None = None
        self.shapes_in = ShapeReader()  # (those numbered in ``inp``)
        # What takes the eager messages at the front of ``inp`` whose receives are posted, the
        # common case, in C where the ring and the mailbox are compiled (see shm_eager); None:
        # the general reader (``_take``) takes every record.
        self.take_eager: EagerReader | None = None
        self.write_eager: EagerWriter | None = None  # (its twin on the writing side)
        # The loop's thread is inside a multi-step read of ``inp`` or write into ``out`` (in
        # Python: a record peeked, not yet freed; a shape numbered, not yet written): a thread
        # that takes or writes records itself (shm_here) leaves the ring alone meanwhile.
        self.draining = False
        self.writing = False
        self.cma = False  # the peer may read our memory directly (it said so)
        # Doorbells (shm_segment.Doorbell): the read end of ours, which the peer writes to wake
        # us (and its name until the peer has opened it), and the write end of the peer's.
        self.bell_in: socket.socket | None = None
        self.bell_in_name: str | None = None
        self.bell_out: socket.socket | None = None
        self.backlog: deque[_Send] = deque()
        self.unacked: deque[_Send] = deque()
        self.acks_seen = 0
        self.descs_written = 0  # descriptors written into ``out`` (the next one's number)
        self.room_timer: asyncio.TimerHandle | None = None
        self.blocked_at = 0  # how far the reader had freed the ring when a write found no room
        self.recheck_timer: asyncio.TimerHandle | None = None
        # A caller's thread wrote while the peer polled and asked this loop to look again
        # (``wake_peer_asked``); it asks no more until this loop rang or began that look.
        self.recheck_asked = False
        # reading side
        self.busy = False  # a single-copy read is under way (records behind it wait)
        self.reader: asyncio.Task[None] | None = None
        self.read_recv: Receive | None = None  # the receive a single-copy read fills
        self.read_dst: memoryview | None = None  # where it copies to (moved when the receive is withdrawn)
        self.read_held = False  # read_dst is a held buffer (counted under the unexpected cap)
        self.read_upto = 0  # bytes of it copied so far
        self.read_key: Key = (0, 0, 0)
        self.read_dropped = False  # its operation was abandoned: stop, drop what was read
        self.descs_read = 0  # descriptors taken from ``inp`` (the next one's number)
        self.part: _Part | None = None
        self.park_timer: asyncio.TimerHandle | None = None
        self.park_expired = False
        self.stalled = False  # the next record waits for a receive or for room under the cap
        self.need = 0  # bytes the next record needs under the cap (0: it waits for its receive)
        self.broken: BaseException | None = None
        # The peer has gone: what it wrote is all there will be, and its sends that completed
        # count on it being delivered. The last drain neither parks a record nor heeds the
        # cap: the ring bounds what it can hold.
        self.last_drain = False

    # -- writing -------------------------------------------------------------------------
    def send(self, key: Key, payload: memoryview, fp: Fingerprint | None) -> asyncio.Future[None]:
        paths = self.paths
        n = payload.nbytes
        out = self.out
        assert out is not None
        eager = n <= paths.eager
        if eager and not self.backlog:
            write = self.write_eager
            wrote = -1 if write is None else write(out, self.shapes_out, key, fp, payload)
            if wrote < 0:
                wrote = self._write_data(out, key, fp, payload)
            if wrote:
                paths.bytes_sent += n
                self.wake_peer()
                return paths.done
        loop = paths.loop
        kind = DATA if eager else (DESC if self.cma and payload.contiguous else PART)
        self.backlog.append(_Send(kind, key, fp, payload, loop.create_future()))
        entry = self.backlog[-1]
        self.flush()
        return entry.future

    def flush(self) -> None:
        """Write what the backlog holds while the ring has room."""
        if self.room_timer is not None:
            self.room_timer.cancel()
            self.room_timer = None
        out = self.out
        if out is None:
            return
        paths = self.paths
        wrote = False
        while self.backlog:
            s = self.backlog[0]
            if s.kind == DATA:
                if not self._write_data(out, s.key, s.fp, s.payload):
                    break
                paths.bytes_sent += s.payload.nbytes
                _resolve(s.future)
            elif s.kind == DESC:
                if len(self.unacked) >= DESC_SLOTS:
                    break  # (its withdrawal slot is still in use: wait for a claim)
                desc = [DESC, *s.key, s.fp, s.payload.nbytes, paths.pid, address_of(s.payload)]
                if not out.try_write(paths.packb(desc), _EMPTY):
                    break
                s.desc = self.descs_written
                self.descs_written += 1
                self.unacked.append(s)
            elif s.kind == DROP:
                if not out.try_write(_DROP_HEADER, _EMPTY):
                    break
            else:  # PART then MOREs
                total = s.payload.nbytes
                while s.offset < total:
                    end = min(total, s.offset + PIECE)
                    head = paths.packb([PART, *s.key, s.fp, total]) if s.offset == 0 else _MORE_HEADER
                    if not out.try_write(head, s.payload[s.offset : end]):
                        break
                    paths.bytes_sent += end - s.offset
                    s.offset = end
                    wrote = True
                if s.offset < total:
                    break
                _resolve(s.future)
            self.backlog.popleft()
            wrote = True
        if self.backlog:
            # No room: look again soon (the reader's doorbell after it frees room comes first,
            # usually; a polling loop looks as soon as the reader has moved).
            self.blocked_at = out.consumed()
            out.words[W_BLOCKED] = 1
            self.room_timer = paths.loop.call_later(ROOM_RETRY, self.flush)
        elif out.words[W_BLOCKED]:
            out.words[W_BLOCKED] = 0
        if wrote:
            paths.moved += 1
            self.wake_peer()

    def _write_data(self, out: Rings, key: Key, fp: Fingerprint | None, payload: memoryview) -> bool:
        """Write an eager data record (its fingerprint's shape first, where new); False: no room."""
        self.writing = True
        try:
            define, header = self.shapes_out.header(key, fp)
            if define is not None and not out.try_write(define, _EMPTY):
                self.shapes_out.forget_last()
                return False
            if header is None:
                header = self.paths.packb([DATA, key[0], key[1], key[2], fp])
            return out.try_write(header, payload)
        finally:
            self.writing = False

    def out_freed(self) -> bool:
        """The reader has freed room since a write last found none."""
        return self.out is not None and self.out.consumed() != self.blocked_at

    def check_acks(self) -> None:
        """Complete the sends whose descriptors the peer has read."""
        out = self.out
        if out is None or not self.unacked:
            return
        acked = int(out.words[W_ACKED])
        if self.acks_seen < acked:
            self.paths.moved += 1
        while self.acks_seen < acked and self.unacked:
            s = self.unacked.popleft()
            self.acks_seen += 1
            if not s.withdrawn:
                self.paths.bytes_sent += s.payload.nbytes
                _resolve(s.future)
        out.words[W_SEEN] = self.acks_seen  # (the reader's second look asks whether we saw them)
        if self.backlog and len(self.unacked) < DESC_SLOTS:
            self.flush()  # (descriptors that waited for a free slot)

    # -- taking messages back --------------------------------------------------------------
    def withdraw(self, fut: asyncio.Future[None]) -> bool:
        """Take back the message whose send is ``fut``: True if nothing of it will be delivered
        (the caller fails ``fut``); False if it is delivered or whole in the ring (``fut`` is done)."""
        for s in self.backlog:
            if s.future is fut:
                self._unqueue(s)
                return True
        for s in self.unacked:
            if s.future is fut:
                return self._take_back(s)
        return False

    def withdraw_key(self, key: Key) -> None:
        """Take back every message of the operation ``key`` that is not the reader's yet (their
        sends stay pending: the operation awaiting them is being failed with its own error)."""
        for s in [s for s in self.backlog if s.key == key]:
            self._unqueue(s)
        for s in self.unacked:
            if s.key == key:
                self._take_back(s)

    def _unqueue(self, s: _Send) -> None:
        if s.kind == PART and s.offset > 0:
            # Pieces of it are in the ring: end the message there, withdrawn.
            self.backlog[self.backlog.index(s)] = _Send(DROP, s.key, None, _EMPTY, self.paths.done)
            self.flush()
        else:
            self.backlog.remove(s)

    def _take_back(self, s: _Send) -> bool:
        """Withdraw the descriptor ``s`` unless the reader has claimed it (see ``shm_segment``):
        True if withdrawn; False if claimed, and then its send completes now."""
        out = self.out
        if out is None or s.withdrawn:
            return s.withdrawn
        d, slot = s.desc, s.desc % DESC_SLOTS
        out.words[W_WITHDRAWN + slot] = d + 1
        fence()
        claimed = int(out.words[W_ACKED]) > d
        out.words[W_VERDICT + slot] = 2 * (d + 1) + claimed
        if claimed:
            _resolve(s.future)
            return False
        s.withdrawn = True
        self.wake_peer()  # (a reader waiting for the verdict looks again)
        return True

    def peer_polls(self) -> bool:
        """The peer's loop is polling now (its flag in the segment it writes)."""
        inp = self.inp
        return SKIP_BELLS and inp is not None and bool(inp.words[W_POLLING])

    def wake_peer(self) -> bool:
        """The peer has something to look at (records, room, completions): ring unless it polls
        (then look again shortly, ``_recheck``). True where it rang."""
        if self.peer_polls():
            inp = self.inp
            if inp is not None:
                inp.wake_sleepers()  # (a caller's thread of the peer asleep on our records)
            if self.recheck_timer is None:
                self.recheck_timer = self.paths.loop.call_later(RECHECK, self._recheck)
            return False
        self.paths.bell(self.peer)
        return True

    def wake_peer_asked(self) -> None:
        """``wake_peer``, asked for by a caller's thread that wrote while the peer polled
        (``shm_here.send_here``). A doorbell now, or the look again later, covers every record
        written before it: the thread asks again after the doorbell, or once that look began."""
        if self.wake_peer():
            self.recheck_asked = False

    def _recheck(self) -> None:
        # Our stores are visible by now: a peer that still polls will see them; one that has
        # stopped may have looked just before they landed: ring if it left something unseen
        # (records unread, completions unnoticed). A spurious doorbell would wake it for nothing.
        self.recheck_timer = None
        self.recheck_asked = False
        if self.peer_polls():
            return
        out, inp = self.out, self.inp
        unread = out is not None and out.consumed() < out.head
        unnoticed = inp is not None and int(inp.words[W_ACKED]) > int(inp.words[W_SEEN])
        if unread or unnoticed:
            self.paths.bell(self.peer)

    # -- reading -------------------------------------------------------------------------
    def readable(self) -> bool:
        """Records may be taken from ``inp`` now: it is set up, not broken, not behind a
        single-copy read under way, and not being read to its end after the peer left."""
        return (
            self.inp is not None
            and self.in_state == _ON
            and not self.busy
            and self.broken is None
            and not self.last_drain
        )

    def drain(self) -> None:
        """Take every record the peer has written, in order, until one has to wait."""
        inp = self.inp
        if inp is None or self.in_state != _ON or self.busy or self.broken is not None:
            return
        freed = False
        paths = self.paths
        eager = self.take_eager
        if eager is not None and paths.closing():
            eager = None  # (after our goodbye nothing is delivered: _take drops it)
        self.draining = True
        try:
            while True:
                if eager is not None:
                    taken, delivered = eager(inp, self.shapes_in, paths.mailbox, self.peer)
                    if taken:
                        paths.bytes_received += delivered
                        self.stalled = False
                        self.need = 0
                        self._stop_parking()
                        freed = True
                rec = inp.peek()
                if rec is None:
                    break
                head, payload, rlen = rec
                if not self._take(head, payload):
                    self.stalled = True
                    break
                self.stalled = False
                self.need = 0
                self._stop_parking()  # (whichever way the record was taken)
                inp.advance(rlen)
                freed = True
                if self.busy:
                    break
        except (ValueError, ProtocolError) as exc:
            self.paths.broken_link(self.peer, f"rank {self.peer} wrote nonsense into shared memory: {exc}")
            return
        finally:
            self.draining = False
        if freed:
            self.paths.moved += 1
            if self.out is not None:
                self.out.wake_sleepers()  # (a caller's thread here whose record this took)
            if inp.words[W_BLOCKED]:
                self.wake_peer()

    def _take(self, raw: memoryview, payload: memoryview) -> bool:
        """Handle one record; False: it must wait (the record stays in the ring)."""
        paths = self.paths
        mailbox = paths.mailbox
        if raw.nbytes == BIN_DATA.size and raw[0] == BIN_TAG:  # eager data: the common case
            key, fp = self.shapes_in.data(raw)
            return paths.closing() or self._take_data(key, fp, payload)
        decoded = decode_header(raw, DEFAULT_LIMITS)
        if type(decoded) is list and decoded and decoded[0] == SHAPE:
            self.shapes_in.define(decoded)
            return True
        rh = decode_record_header(decoded, payload.nbytes)
        if rh.kind == MORE:
            return self._piece(payload)
        if rh.kind == DROP:
            self._dropped_part()
            return True
        key, fp, n = rh.key, rh.fp, rh.nbytes
        if paths.closing():  # we said goodbye: nothing that arrives matters now
            if rh.kind == PART:  # (its pieces follow: drop them too)
                self.part = _Part(key, fp, n, None, None, held=False)
                return self._piece(payload)
            return True
        if rh.kind == DATA:
            return self._take_data(key, fp, payload)
        if rh.kind == PART:
            target = mailbox.match(self.peer, key, n, fp)
            if target is not None and target is not DISCARD:
                self.part = _Part(key, fp, n, target.buf, target, held=False)
            elif target is DISCARD:
                self.part = _Part(key, fp, n, None, None, held=False)
            else:
                if self._park(n):
                    return False
                if not self._room_for(n):
                    return self._no_room(n)
                paths.reserve(n)
                self.part = _Part(key, fp, n, memoryview(bytearray(n)), None, held=True)
            return self._piece(payload)
        # DESC: only ever a read of the process that offered the segment (and passed the probe)
        if rh.pid != self.peer_pid:
            raise ProtocolError(f"rank {self.peer} sent a descriptor of another process ({rh.pid})")
        if self.last_drain:
            # Its send had not completed (it completes once read), so nothing was promised; the
            # memory it names is no longer the sender's to lend.
            return True
        target = mailbox.match(self.peer, key, n, fp)
        if target is not None and target is not DISCARD:
            self._start_read(rh.pid, rh.addr, target.buf, target, key, fp)
            return True
        if target is DISCARD:
            self.descs_read += 1
            self._ack()  # (claimed unread: the writer's send completes, as a socket's would)
            return True
        if self._park(n):
            return False
        if not self._room_for(n):
            return self._no_room(n)
        paths.reserve(n)
        self._start_read(rh.pid, rh.addr, memoryview(bytearray(n)), None, key, fp)
        return True

    def _take_data(self, key: Key, fp: Fingerprint | None, payload: memoryview) -> bool:
        """An eager message: into its posted receive, else held (False: it must wait)."""
        paths = self.paths
        mailbox = paths.mailbox
        n = payload.nbytes
        target = mailbox.match(self.peer, key, n, fp)
        if target is not None and target is not DISCARD:
            target.buf[:] = payload
            paths.bytes_received += n
            mailbox.complete(target, self.peer)
            return True
        if target is DISCARD:
            return True
        if n > HOLD_AT_ONCE and self._park(n):
            return False
        if n and not self._room_for(n):
            return self._no_room(n)
        paths.bytes_received += n
        mailbox.deliver(self.peer, key, fp, payload, owned=False)
        return True

    def _park(self, n: int) -> bool:
        """A large message whose receive is not posted: True while it should wait for it.

        Usually the receive is a moment away (the sender is one call ahead); after a short
        wait the message is held instead, so that records behind it (and the sender's send)
        are not held up by a receive that may never come.
        """
        self.need = 0
        if self.park_expired or self.last_drain:
            return False
        if self.park_timer is None:
            self.park_timer = self.paths.loop.call_later(min(0.05, max(0.005, n / 1e9)), self._park_over)
        return True

    def _room_for(self, n: int) -> bool:
        return self.last_drain or self.paths.room_for(n)

    def _no_room(self, n: int) -> bool:
        self.need = n
        return False

    def _piece(self, payload: memoryview) -> bool:
        part = self.part
        if part is None:
            raise ProtocolError(f"rank {self.peer} sent a piece of a message it never started")
        end = part.offset + payload.nbytes
        if end > part.total:
            raise ProtocolError(f"rank {self.peer} sent more pieces than its message has")
        if part.buf is not None:
            part.buf[part.offset : end] = payload
            self.paths.bytes_received += payload.nbytes
        part.offset = end
        if end == part.total:
            self.part = None
            if part.buf is not None:
                self._finish(part.key, part.fp, part.buf, part.recv, part.held)
        return True

    def _dropped_part(self) -> None:
        """The writer took back the message arriving in pieces (its send failed): drop it; its
        receive waits for the next message."""
        part = self.part
        if part is None:
            raise ProtocolError(f"rank {self.peer} withdrew a message in pieces it never started")
        self.part = None
        if part.recv is not None:
            self.paths.mailbox.repost(part.recv)
        elif part.held and part.buf is not None:
            self.paths.unreserve(part.total)

    def _finish(
        self, key: Key, fp: Fingerprint | None, buf: memoryview, recv: Receive | None, held: bool
    ) -> None:
        mailbox = self.paths.mailbox
        if recv is not None:
            mailbox.complete(recv, self.peer)
        elif held:
            self.paths.unreserve(buf.nbytes)
            mailbox.deliver(self.peer, key, fp, buf, owned=True)

    def _park_over(self) -> None:
        self.park_timer = None
        self.park_expired = True
        self.drain()

    def _stop_parking(self) -> None:
        if self.park_timer is not None:
            self.park_timer.cancel()
            self.park_timer = None
        self.park_expired = False

    def _start_read(
        self, pid: int, addr: int, dst: memoryview, recv: Receive | None, key: Key, fp: Fingerprint | None
    ) -> None:
        self.busy = True
        self.read_recv = recv
        self.read_dst = dst
        self.read_upto = 0
        self.read_held = recv is None  # (reserved under the cap)
        self.read_key = key
        self.read_dropped = False
        d = self.descs_read
        self.descs_read += 1
        self.reader = self.paths.loop.create_task(self._read(pid, addr, d, fp))

    async def _read(self, pid: int, addr: int, d: int, fp: Fingerprint | None) -> None:
        """Copy descriptor ``d``'s bytes, ``CMA_CHUNK`` at a time, into ``read_dst`` (the receive's
        buffer, or a held one: it may change between chunks, see ``release_receive``), then
        claim it: the message is delivered unless the writer took it back."""
        paths = self.paths
        inp = self.inp
        assert inp is not None and self.read_dst is not None  # (set with the task, kept until it ends)
        n = self.read_dst.nbytes
        withdrawn = W_WITHDRAWN + d % DESC_SLOTS
        try:
            for start in range(0, n, CMA_CHUNK):
                if self.read_dropped or int(inp.words[withdrawn]) == d + 1:
                    break  # nobody wants the rest: the operation was abandoned here, or the send
                end = min(n, start + CMA_CHUNK)
                cma_read(pid, addr + start, self.read_dst[start:end])
                self.read_upto = end
                if end < n:
                    await asyncio.sleep(0)  # keep the loop responsive during a big read
            else:  # (read whole: nothing could change since the last look, no await came between)
                # Claim it, then look whether the writer took it back (the handshake of
                # shm_segment): with no withdrawal seen, it is ours.
                self._ack()
                fence()
                if int(inp.words[withdrawn]) != d + 1 or await self._verdict(d):
                    self._delivered(fp)
                else:
                    self._undelivered()
                return
            if not self.read_dropped:
                # Taken back before we were done: no claim until its verdict, which then says
                # "withdrawn" (there was no claim); the claim frees its slot.
                await self._verdict(d)
            self._ack()  # (an abandoned operation's: claimed unread, as a socket would take it)
            self._undelivered()
        except OSError as exc:
            if exc.errno == errno.ESRCH:  # the same fault as a connection lost mid-frame: say it alike
                what = (
                    f"rank {self.peer} died without saying goodbye while rank {paths.rank} was reading its "
                    "message from its memory: the process is gone (killed or crashed)"
                )
            else:
                what = f"rank {paths.rank} could not read rank {self.peer}'s message from its memory ({exc.strerror})"
            err = DistNetworkError(what)
            if self.read_recv is not None:
                _fail(self.read_recv.future, err)
            self._end_read(delivered=False)
            paths.broken_link(self.peer, str(err))
        except asyncio.CancelledError:
            self._end_read(delivered=False)
            raise
        except Exception as exc:  # a bug of ours must not leave the ring waiting on this read
            log.exception("aiodist: rank %d: internal error reading rank %d's message", paths.rank, self.peer)
            if self.read_recv is not None:
                _fail(
                    self.read_recv.future,
                    DistNetworkError(f"internal error reading from rank {self.peer}: {exc!r}"),
                )
            self._end_read(delivered=False)
            paths.broken_link(self.peer, f"internal error while reading its message: {exc!r}")

    async def _verdict(self, d: int) -> bool:
        """The writer's verdict on descriptor ``d``, which it took back: True if it saw our claim
        first (the message is ours), False if withdrawn. It writes the verdict right after the
        withdrawal; until then, look again now and then."""
        slot = W_VERDICT + d % DESC_SLOTS
        while (inp := self.inp) is not None:
            v = int(inp.words[slot])
            if v >> 1 == d + 1:
                return bool(v & 1)
            await asyncio.sleep(VERDICT_POLL)
        return False

    def _delivered(self, fp: Fingerprint | None) -> None:
        if self.read_dropped:  # (abandoned while we waited for the verdict)
            self._undelivered()
            return
        dst, recv, held, key = self.read_dst, self.read_recv, self.read_held, self.read_key
        assert dst is not None
        self.paths.bytes_received += dst.nbytes
        self.paths.moved += 1
        self._end_read(delivered=True)
        self._finish(key, fp, dst, recv, held)
        self.drain()

    def _undelivered(self) -> None:
        """The read ends without a delivery: its receive (if still wanted) waits for the next message."""
        recv = self.read_recv
        self._end_read(delivered=False)
        if recv is not None:
            self.paths.mailbox.repost(recv)
        self.paths.moved += 1
        self.drain()

    def _end_read(self, *, delivered: bool) -> None:
        if self.read_held and not delivered and self.read_dst is not None:
            self.paths.unreserve(self.read_dst.nbytes)
        self.busy = False
        self.reader = None
        self.read_recv = None
        self.read_dst = None
        self.read_held = False

    def release_receive(self, fut: asyncio.Future[int]) -> None:
        """The receive ``fut`` was withdrawn (its timeout, a cancellation): a message arriving
        for it (in pieces, or by a single-copy read) is held for the next receive instead, what
        came of it so far included; nothing more is written into the receive's buffer."""
        part = self.part
        if part is not None and part.recv is not None and part.recv.future is fut and part.buf is not None:
            part.buf = _held_copy(part.buf, part.offset)
            part.recv, part.held = None, True
            self.paths.reserve(part.total)
        recv, dst = self.read_recv, self.read_dst
        if recv is not None and recv.future is fut and dst is not None:
            # (between two chunks: the reader task resumes with the new destination)
            self.read_dst = _held_copy(dst, self.read_upto)
            self.read_recv, self.read_held = None, True
            self.paths.reserve(dst.nbytes)

    def abandon(self, key: Key) -> None:
        """The operation ``key`` was abandoned here: the rest of a message of it arriving is
        dropped, and our own sends of it that are not the peer's yet are taken back."""
        part = self.part
        if part is not None and part.key == key and part.buf is not None:
            if part.held:
                self.paths.unreserve(part.total)
            part.buf, part.recv, part.held = None, None, False
        if self.busy and self.read_key == key:
            # (the reader copies no further chunk: it looks at this before each one)
            self.read_dropped = True
            self.read_recv = None
        self.withdraw_key(key)

    def _ack(self) -> None:
        inp = self.inp
        assert inp is not None
        inp.words[W_ACKED] = int(inp.words[W_ACKED]) + 1
        self.wake_peer()

    # -- lifetime ------------------------------------------------------------------------
    def fail(self, exc: BaseException) -> None:
        """The peer is gone: fail what waits on this link, stop reading, unmap."""
        if self.broken is None:
            self.broken = exc
        for t in (self.room_timer, self.recheck_timer, self.park_timer):
            if t is not None:
                t.cancel()
        self.room_timer = self.recheck_timer = self.park_timer = None
        for s in self.unacked:
            self._take_back(s)  # (a reader still at it must not deliver what we no longer lend)
        for s in list(self.backlog) + list(self.unacked):
            _fail(s.future, exc)
        self.backlog.clear()
        self.unacked.clear()
        if self.reader is not None and not self.reader.done():
            self.reader.cancel()
            if self.read_recv is not None:
                _fail(self.read_recv.future, exc)
        self._end_read(delivered=False)
        self.out_state = self.in_state = _OFF
        self.out = self.inp = None
        self.stalled = False  # (nothing will be read from it: no retry may wait on it)
        self.need = 0
        part = self.part
        if part is not None and part.held and part.buf is not None:
            self.paths.unreserve(part.buf.nbytes)
        if part is not None and part.recv is not None:
            # (matched, so no longer posted: the mailbox's failure of the peer cannot reach it)
            _fail(part.recv.future, exc)
        self.part = None
        for seg in (self.out_seg, self.in_seg):
            if seg is not None:
                seg.close()
        self.out_seg = self.in_seg = None
        self.drop_bell_in()
        if self.bell_out is not None:
            self.bell_out.close()
            self.bell_out = None

    def drop_bell_in(self) -> None:
        """Stop listening on our doorbell, and remove its name if it is still there."""
        if self.bell_in_name is not None:
            unlink_name(self.bell_in_name)
            self.bell_in_name = None
        if self.bell_in is not None:
            self.paths.loop.remove_reader(self.bell_in)
            self.bell_in.close()
            self.bell_in = None


_EMPTY = memoryview(b"")
_MORE_HEADER = b"\x91\x03"  # msgpack of [MORE]
_DROP_HEADER = b"\x91\x04"  # msgpack of [DROP]


def _fail(fut: asyncio.Future[Any], exc: BaseException) -> None:
    # (marked retrieved: a failed operation may no longer await its sends)
    if not fut.done():
        fut.set_exception(exc)
        fut.exception()


def _held_copy(buf: memoryview, upto: int) -> memoryview:
    """A buffer of ``buf``'s size for the message it was receiving, holding its first ``upto`` bytes."""
    held = memoryview(bytearray(buf.nbytes))
    held[:upto] = buf[:upto]
    return held


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class ShmPaths:
    """The shared-memory links of one TCP transport (see the module docstring).

    ``owner`` is the transport: it sends the setup frames and doorbells (``send_frame``), and
    gives the mailbox, the unexpected-message cap and the loop.
    """

    def __init__(
        self,
        rank: int,
        loop: asyncio.AbstractEventLoop,
        mailbox: Matcher,
        job: str,
        settings: Settings,
        *,
        send_frame: Callable[[int, ShmMessage], None],
        room_for: Callable[[int], bool],
        reserve: Callable[[int], None],
        closing: Callable[[], bool],
        broken: Callable[[int, str], None],
    ) -> None:
        self.rank = rank
        self.loop = loop
        self.mailbox = mailbox
        self.mode = settings.shm
        self.host = _host.host_id()
        self.job = job_token(job, settings.shm_job)
        self.pid = os.getpid()
        self.links: dict[int, _Link] = {}
        self.send_frame = send_frame
        self.room_for = room_for
        self._reserve = reserve
        self.closing = closing
        self._broken = broken
        self.done: asyncio.Future[None] = loop.create_future()
        self.done.set_result(None)
        self.settled: asyncio.Future[None] = loop.create_future()
        self.expected: set[int] | None = None  # (None: nobody waits for ``settled`` yet)
        self.bytes_sent = 0  # payload bytes through shared memory (both copies and single-copy)
        self.bytes_received = 0
        # Messages sent and received on a blocking caller's own thread (shm_here).
        self.sent_here = 0
        self.received_here = 0
        self._polling = False
        # A caller's thread looks at rings for a whole operation (``shm_here.look_here``): it
        # keeps the flags raised throughout, not each wait on its own.
        self.looking = False
        self.eager = EAGER if _host.has_core_per_rank() else EAGER_SHARED_CORES
        self.moved = 0  # counts what moved on any link (records, reads, completions, writes)
        self._moved_seen = 0
        self._packer = msgpack.Packer(use_bin_type=True)
        self.new_ring = ring_type()  # (the engine's choice, made now: a part it lacks fails here)

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def packb(self, obj: Any) -> bytes:
        return bytes(self._packer.pack(obj))

    def reserve(self, n: int) -> None:
        self._reserve(n)

    def unreserve(self, n: int) -> None:
        self._reserve(-n)

    # -- what the host-aware layer asks ----------------------------------------------------
    def local_peers(self) -> list[int]:
        """Peers whose data messages to this rank, and this rank's to them, go through shared memory."""
        return sorted(p for p, link in self.links.items() if link.out_state == _ON and link.in_state == _ON)

    # -- setup -----------------------------------------------------------------------------
    def expect(self, peers: list[int]) -> None:
        """The peers whose setup ``settled`` waits for."""
        self.expected = set(peers)
        self._check_settled()

    def connected(self, peer: int) -> None:
        """The handshake with ``peer`` completed: say who we are."""
        self.links[peer] = _Link(self, peer)
        self.send_frame(peer, ShmHello(self.host, self.enabled))

    def message(self, peer: int, msg: ShmMessage) -> None:
        """A setup frame or a doorbell from ``peer`` (on its TCP connection, in order)."""
        link = self.links.get(peer)
        if link is None or link.broken is not None:
            return
        if isinstance(msg, ShmBell):
            self.poll_link(link)
        elif isinstance(msg, ShmHello):
            self._hello(link, msg)
        elif isinstance(msg, ShmOffer):
            self._offer(link, msg)
        elif isinstance(msg, ShmAccept):
            self._accepted(link, msg)
        elif isinstance(msg, ShmDecline):
            self._declined(link, msg)
        elif isinstance(msg, ShmStart):
            if link.bell_in_name is not None:  # (the peer has opened it, or never will)
                unlink_name(link.bell_in_name)
                link.bell_in_name = None
            if link.in_seg is not None and link.in_state == _PENDING:
                link.inp = self.new_ring(link.in_seg)
                link.take_eager = reader_for(link.inp, self.mailbox)
                link.in_state = _ON
            self._check_settled()
            link.drain()

    def _hello(self, link: _Link, hello: ShmHello) -> None:
        if not (self.enabled and hello.enabled and hello.host == self.host):
            link.out_state = link.in_state = _OFF
            self._check_settled()
            return
        try:
            seg = Segment.create(self.job)
        except OSError as exc:
            log.debug("aiodist: rank %d: no shared memory towards rank %d: %s", self.rank, link.peer, exc)
            link.out_state = _OFF
            self.send_frame(link.peer, ShmDecline(str(exc), own=True))
            self._check_settled()
            return
        link.out_seg = seg
        self.send_frame(link.peer, ShmOffer(seg.name, seg.nonce, self.pid, seg.address()))

    def _offer(self, link: _Link, offer: ShmOffer) -> None:
        try:
            seg = Segment.attach(offer.name)
        except (OSError, ValueError) as exc:
            self._refuse(link, f"cannot map {offer.name}: {exc}")
            return
        if seg.nonce != offer.nonce:
            seg.close()
            self._refuse(link, "the segment holds another nonce")
            return
        cma = False
        if self.mode == "on" and TSO:  # (the descriptors' handshake needs x86's ordering: shm_segment)
            probe = memoryview(bytearray(16))
            try:
                cma_read(offer.pid, offer.addr + 8, probe)
                cma = bytes(probe) == offer.nonce
            except OSError as exc:
                log.debug(
                    "aiodist: rank %d: no single-copy reads from rank %d: %s", self.rank, link.peer, exc
                )
        echo = os.urandom(16)
        seg.view[ECHO] = echo
        link.in_seg = seg
        link.peer_pid = offer.pid if cma else 0
        self.send_frame(link.peer, ShmAccept(echo, cma, self._doorbell(link)))

    def _doorbell(self, link: _Link) -> str:
        """Make the doorbell ``link``'s peer will wake us through; its name ("": none, the
        peer rings with frames)."""
        try:
            name, sock = Doorbell.create(self.job)
        except OSError as exc:
            log.debug("aiodist: rank %d: no doorbell for rank %d: %s", self.rank, link.peer, exc)
            return ""
        link.bell_in, link.bell_in_name = sock, name
        self.loop.add_reader(sock, self._rung, link)
        return name

    def _rung(self, link: _Link) -> None:
        if link.bell_in is not None:
            Doorbell.take(link.bell_in)
        self.poll_link(link)

    def _refuse(self, link: _Link, why: str) -> None:
        log.debug("aiodist: rank %d: shared memory from rank %d refused: %s", self.rank, link.peer, why)
        link.in_state = _OFF
        self.send_frame(link.peer, ShmDecline(why))
        self._check_settled()

    def _accepted(self, link: _Link, acc: ShmAccept) -> None:
        seg = link.out_seg
        if seg is None or link.out_state != _PENDING:
            return
        seg.unlink()  # both ends map it: nothing need stay in the directory
        if bytes(seg.view[ECHO]) != acc.echo:
            log.debug("aiodist: rank %d: rank %d maps other memory than ours", self.rank, link.peer)
            seg.close()
            link.out_seg = None
            link.out_state = _OFF
            self.send_frame(link.peer, ShmDecline("the echo differs", own=True))
            self._check_settled()
            return
        link.cma = acc.cma
        if acc.bell:
            try:
                link.bell_out = Doorbell.open(acc.bell)
            except (OSError, ValueError) as exc:
                log.debug(
                    "aiodist: rank %d: rank %d's doorbell is not ours to ring: %s", self.rank, link.peer, exc
                )
        link.out = self.new_ring(seg)
        link.write_eager = writer_for(link.out)
        if self._polling:
            seg.words[W_POLLING] = 1
        self.send_frame(link.peer, ShmStart())
        link.out_state = _ON
        self._check_settled()

    def _declined(self, link: _Link, dec: ShmDecline) -> None:
        if dec.own:  # the peer will not write to us through memory
            link.in_state = _OFF
            link.drop_bell_in()
            if link.in_seg is not None:
                link.in_seg.close()
                link.in_seg = None
        else:  # it could not use our segment
            log.debug("aiodist: rank %d: rank %d refused shared memory: %s", self.rank, link.peer, dec.reason)
            link.out_state = _OFF
            if link.out_seg is not None:
                link.out_seg.close()
                link.out_seg = None
        self._check_settled()

    def _check_settled(self) -> None:
        if self.settled.done() or self.expected is None:
            return
        for peer in self.expected:
            link = self.links.get(peer)
            if link is None or _PENDING in (link.out_state, link.in_state):
                return
        self.settled.set_result(None)

    # -- data path ---------------------------------------------------------------------------
    def link_to(self, peer: int) -> _Link | None:
        """The link whose ring carries data to ``peer``, or None (TCP)."""
        link = self.links.get(peer)
        return link if link is not None and link.out_state == _ON and link.broken is None else None

    def bell(self, peer: int) -> None:
        """Wake ``peer`` to look at its rings: a byte into its doorbell, else a frame."""
        link = self.links.get(peer)
        if link is not None and link.bell_out is not None:
            if Doorbell.ring(link.bell_out):
                return
            link.bell_out.close()  # (its reader has gone: the frame says what there is to say)
            link.bell_out = None
        self.send_frame(peer, ShmBell())

    def poll_link(self, link: _Link) -> None:
        link.drain()
        link.check_acks()
        if link.backlog:
            link.flush()

    def release_receive(self, fut: asyncio.Future[int]) -> None:
        """The receive ``fut`` was withdrawn: see ``_Link.release_receive``."""
        for link in self.links.values():
            link.release_receive(fut)

    def abandon(self, key: Key) -> None:
        """The operation ``key`` was abandoned here: see ``_Link.abandon``."""
        for link in self.links.values():
            link.abandon(key)

    def drain_from(self, peer: int) -> None:
        """Before a TCP frame of ``peer`` is handled: what it wrote to memory before came first."""
        link = self.links.get(peer)
        if link is not None and link.inp is not None:
            link.drain()

    def poll(self) -> bool:
        """One look at every link (the busy poller calls it on every turn of the loop); True if
        something moved (records, reads, completions, room) since the last look."""
        for link in self.links.values():
            if link.inp is not None and not link.busy and (link.stalled is False) and link.inp.pending():
                link.drain()
            if link.unacked:
                link.check_acks()
            if link.backlog and (link.room_timer is None or link.out_freed()):
                link.flush()
        moved = self.moved != self._moved_seen
        self._moved_seen = self.moved
        return moved

    @property
    def stalled(self) -> bool:
        """Some link waits for a receive to be posted or for room under the unexpected cap."""
        return any(link.stalled for link in self.links.values())

    def capped(self) -> list[tuple[int, int]]:
        """(peer, bytes needed) of the links whose next record waits for room under the cap."""
        return [(p, link.need) for p, link in self.links.items() if link.stalled and link.need]

    def retry(self) -> None:
        """A receive was posted or held memory freed: records that waited may go on."""
        for link in self.links.values():
            if link.stalled:
                link.drain()

    @property
    def polling(self) -> bool:
        """This loop polls the rings now (``set_polling``)."""
        return self._polling

    def set_polling(self, polling: bool) -> None:
        """This loop starts or stops polling: writers may skip our doorbells meanwhile."""
        self._polling = polling
        flag = 1 if polling else 0
        for link in self.links.values():
            if link.out is not None:
                link.out.words[W_POLLING] = flag
        if not polling:
            self.poll()  # what landed while we stopped, with no doorbell sent for it

    # -- failure and lifetime ---------------------------------------------------------------
    def broken_link(self, peer: int, why: str) -> None:
        link = self.links.get(peer)
        if link is not None and link.broken is None:
            err = DistNetworkError(why)
            link.fail(err)
        self._broken(peer, why)

    def drain_departed(self, peer: int) -> None:
        """``peer`` is gone. What it wrote before it went is intact, and a send completes once
        its record is in the ring: deliver (or hold) every record, whether or not its receive is
        posted yet (before the receives still waiting on it fail)."""
        link = self.links.get(peer)
        if link is not None and link.broken is None:
            link.last_drain = True
            link.drain()

    def peer_gone(self, peer: int, exc: BaseException) -> None:
        link = self.links.get(peer)
        if link is None:
            return
        self.drain_departed(peer)
        link.fail(exc)
        self._check_settled()

    def close(self, exc: BaseException) -> None:
        for link in self.links.values():
            link.fail(exc)
        if not self.settled.done():
            self.settled.set_result(None)
