"""A blocking send or receive over shared memory, done on its caller's thread.

The blocking face runs every operation on the runtime's loop thread: the caller hands it over
and sleeps until the loop wakes it, two thread switches that cost more than the whole message
(a few µs in C, tens to hundreds through the hop on a loaded machine). Here a small blocking
``send``/``recv`` with a peer on this host goes without the hop where that is safe:

* a send writes its record into the ring itself (``_shm_eager.write_eager``) when nothing of
  this link is queued or being written by the loop's thread, and rings the peer's doorbell;
* a receive posts itself in line for its key (``post_mine``), then takes its message from
  the front of the ring once it is first in line (``take_mine``), spinning with the GIL
  released for the poll budget (``Ring.wait_pending``) while it waits, then sleeping until the
  writer wakes it (``Ring.sleep_pending``, up to ``SLEEP``), its "polling" flag raised so that
  the writer need not ring. The loop's thread may fill it meanwhile (a wake-up it got anyway); if neither
  has by then, the receive is taken back (``withdraw_mine``) and the operation goes
  the loop's way, from the start, with its timeout and everything else; one that the loop's
  thread matched meanwhile to a message still arriving is handed to the loop's thread to be
  tracked there (its timeout, a lost peer) as any receive.

Each compiled call runs whole under the GIL and calls no Python code, and the loop's thread
marks the multi-step reads and writes it does in Python (``draining``, ``writing``), so the two
threads never interleave inside one. Whatever is not the plain case (a receive from any
source waiting for the key, a mismatch, a queue, a link being set up or broken, the Python
engine) goes the loop's way, which handles it as always. Only compiled links serve here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from aiodist.native import compiled
from aiodist.transport.shm_segment import W_BLOCKED, W_POLLING, Doorbell, fence
from aiodist.wire.fingerprint import Fingerprint
from aiodist.wire.messages import Key

if TYPE_CHECKING:
    from aiodist.transport.shm import ShmPaths

__all__ = ["NAP", "SLEEP", "finish_here", "look_here", "post_here", "recv_here", "send_here", "wait_here"]

#: After its poll budget, a receive on a caller's thread sleeps up to SLEEP s more for its
#: record (Linux: a futex in the segment's header, which the writer wakes after writing), in
#: naps of NAP s at most, looking between them at what the loop's thread did (a failure, a
#: message that came another way). Then it goes the loop's way, as it did at once before: one
#: wake-up (about 16 µs on this project's 2-vCPU guest) instead of two, the doorbell's and the
#: caller's. A writer that cannot wake it (the Python engine) leaves it to its nap's end.
SLEEP = 0.02
NAP = 0.002


def send_here(
    paths: ShmPaths, peer: int, key: Key, payload: memoryview, fp: Fingerprint | None
) -> asyncio.Future[None] | None:
    """Write the message into ``peer``'s ring from this thread: the transport's completed
    future; None (nothing written) where it must go the loop's way."""
    link = paths.link_to(peer)
    if (
        link is None
        or link.write_eager is None
        or link.backlog
        or link.writing
        or payload.nbytes > paths.eager
    ):
        return None
    out = link.out
    if out is None or link.write_eager(out, link.shapes_out, key, fp, payload) != 1:
        return None
    paths.bytes_sent += payload.nbytes
    paths.sent_here += 1
    paths.moved += 1
    bell = link.bell_out
    if link.peer_polls():
        if link.inp is not None:
            link.inp.wake_sleepers()  # (a caller's thread of the peer asleep on this record)
        # (the loop's thread looks again later, for a poller that stops before it sees this:
        # one look covers every record written before it, so one asked for and not yet taken
        # is enough)
        if not link.recheck_asked:
            link.recheck_asked = True
            paths.loop.call_soon_threadsafe(link.wake_peer_asked)
    elif bell is None or not Doorbell.ring(bell):
        paths.loop.call_soon_threadsafe(link.wake_peer)  # (its frame fallback is the loop's)
    return paths.done


def recv_here(
    paths: ShmPaths, peer: int, key: Key, buf: memoryview, fp: Fingerprint | None, budget: float
) -> asyncio.Future[int] | None:
    """Receive ``peer``'s message into ``buf`` on this thread, waiting for it as ``wait_here``
    does: the receive's future, done (its result the sender, or its error: a mismatch the loop's
    thread found, ``peer`` lost), or still pending where the loop's thread matched it to a
    message that is still arriving (the caller has it tracked there, as any receive); None
    where nothing was posted and the receive must go the loop's way."""
    fut = post_here(paths, peer, key, buf, fp)
    if fut is None or wait_here(paths, peer, key, fut, budget):
        return fut
    native: Any = compiled("aiodist.transport._shm_eager")
    if native.withdraw_mine(paths.mailbox, peer, key, fut):
        return None
    return fut  # (matched meanwhile by the loop's thread to a message arriving another way)


def post_here(
    paths: ShmPaths, peer: int, key: Key, buf: memoryview, fp: Fingerprint | None
) -> asyncio.Future[int] | None:
    """Post a receive of ``peer``'s message into ``buf`` from this thread, in line for ``key``
    behind those posted before it: its future (done at once where the message was held here);
    None where nothing was posted and the receive must go the loop's way."""
    native = compiled("aiodist.transport._shm_eager")
    link = paths.links.get(peer)
    if (
        native is None
        or link is None
        or link.take_eager is None
        or not link.readable()
        or buf.nbytes > paths.eager
        or paths.closing()
    ):
        return None
    box = paths.mailbox
    fut: asyncio.Future[int] | None = native.post_mine(box, peer, key, buf, fp)
    if fut is not None and fut.done():  # (a held message: a reader paused at the cap may go on)
        if box.on_drain is not None:
            paths.loop.call_soon_threadsafe(box.on_drain)
        paths.received_here += 1
    return fut


def wait_here(paths: ShmPaths, peer: int, key: Key, fut: asyncio.Future[int], budget: float | None) -> bool:
    """Wait on this thread for the receive ``post_here`` gave ``fut`` for: take its record from
    the front of ``peer``'s ring once it is first in line, spinning with the GIL released
    between looks for ``budget`` s, then sleeping for ``SLEEP`` s more until the writer wakes
    it (``Ring.sleep_pending``); ``budget`` None: look, without waiting. True once ``fut`` is
    done (filled here or by the loop's thread, or failed there); False where it is not: it
    stays posted, and the loop's thread may fill it."""
    if fut.done():
        return True
    native: Any = compiled("aiodist.transport._shm_eager")
    link = paths.links.get(peer)
    if link is None or not link.readable():
        return fut.done()
    inp: Any = link.inp  # (the compiled ring: readable() checked it is there)
    if budget is None:  # (a look, no more: no clock, no flag)
        return (not link.draining and _take(paths, link, native, inp, peer, key, fut)) or fut.done()
    out = link.out
    now = time.monotonic()
    until = now + budget
    wake_by = until + SLEEP if out is not None and inp.can_sleep else until
    flagged = False
    second_look = False
    try:
        while not fut.done():
            if not link.draining and link.readable():
                if _take(paths, link, native, inp, peer, key, fut):
                    break
                if inp.pending():
                    if second_look:
                        break  # another record is first: the loop's thread takes it (and
                        # this receive waits for it behind it)
                    second_look = True  # (or ours landed just after the look)
                    continue
            now = time.monotonic()
            if now >= wake_by:
                break
            if not flagged and out is not None and not paths.looking:
                out.words[W_POLLING] = 1  # (the writer need not ring while this thread looks)
                flagged = True
            if now < until:
                inp.wait_pending(until - now)
            else:  # (the flag raised, the writer wakes this thread instead of ringing)
                inp.sleep_pending(out, min(NAP, wake_by - now))
    finally:
        if flagged and out is not None and not paths.polling:
            out.words[W_POLLING] = 0
            # A record that came meanwhile and that this thread did not take (another
            # operation's, or its own just as it gave up) is the loop's thread's to take: its
            # writer skipped the doorbell, and the writer's look again may have come while
            # the flag was still up (a sleeper that the cores keep waiting past it).
            fence()
            if inp.pending():
                paths.loop.call_soon_threadsafe(paths.poll)
    if fut.done():
        paths.received_here += 1
        return True
    return False


def _take(
    paths: ShmPaths, link: Any, native: Any, inp: Any, peer: int, key: Key, fut: asyncio.Future[int]
) -> bool:
    """Take the record at the front of ``peer``'s ring if it is ``fut``'s message: True once
    taken (``fut`` done)."""
    got = native.take_mine(inp, link.shapes_in, paths.mailbox, peer, key, fut)
    if got < 0:
        return False
    paths.bytes_received += got
    paths.moved += 1
    if inp.words[W_BLOCKED]:  # (the writer waits for room: the loop rings)
        paths.loop.call_soon_threadsafe(link.wake_peer)
    return True


def look_here(paths: ShmPaths, peers: Sequence[int], on: bool) -> None:
    """This thread is about to look at ``peers``' rings for a while (``on``), or has stopped:
    their writers need not ring meanwhile (each step's wait would flag it only once it found
    nothing, too late for a peer that sends at once). When it stops, records it left behind
    (another operation's) are the loop's thread's to take: it is told, since their writers
    may have skipped the doorbell."""
    paths.looking = on
    flag = 1 if on or paths.polling else 0
    links = paths.links
    for p in peers:
        link = links.get(p)  # (None for this rank, and for peers of other hosts)
        if link is not None and link.out is not None:
            link.out.words[W_POLLING] = flag
    if on:
        return
    fence()  # (our flag's store before the looks below: a writer sees one or the other)
    for p in peers:
        link = links.get(p)
        if link is not None and link.inp is not None and link.inp.pending():
            paths.loop.call_soon_threadsafe(paths.poll)
            return


def finish_here(paths: ShmPaths, key: Key) -> bool:
    """Mark the collective ``key`` finished from this thread: True; False (nothing done) where
    a message is still held for it, which the loop's thread reports as late."""
    native: Any = compiled("aiodist.transport._shm_eager")
    return native is not None and bool(native.finish_mine(paths.mailbox, key))
