"""The common case of a shared-memory ring: eager messages, written and read in one call each.

``take_eager`` takes, in order, the records at the front of a ring that are eager data records
(``wire.shm.BIN_DATA`` headers) whose message the mailbox hands to a posted receive (copied
into its buffer, the receive completed) or discards; it stops at the first record that is
anything else (a message to hold, one in pieces, a descriptor, a shape, nonsense), which the
link's general reader (``shm.ShmLink.drain``) then takes. ``_shm_eager.pyx`` is the compiled
twin, the whole loop in C (the ring, the header, the shape table and the matcher's C methods),
which a link runs first on each wake-up where its ring and the mailbox are both compiled
(``reader_for``). This one is its reference: the Python engine does not run it, since its
general reader takes the same records the same way (``_take_data``), one call cheaper.
``write_eager`` is the writing side's, for a record whose shape is numbered already. ``tests/unit/test_native_eager.py`` gives both the same rings and
receives and demands the same outcome.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

from aiodist.native import compiled
from aiodist.transport.matching import DISCARD, Matcher
from aiodist.transport.shm_segment import Rings
from aiodist.wire.fingerprint import Fingerprint
from aiodist.wire.messages import Key
from aiodist.wire.shm import BIN_DATA, BIN_TAG, ShapeReader, ShapeWriter

__all__ = ["EagerReader", "EagerWriter", "reader_for", "take_eager", "write_eager", "writer_for"]

#: ``(ring, shapes, mailbox, peer) -> (records taken, bytes delivered)``
EagerReader: TypeAlias = Callable[[Rings, ShapeReader, Matcher, int], tuple[int, int]]
#: ``(ring, shapes, key, fingerprint, payload) -> 1 written, 0 no room, -1 not this way``
EagerWriter: TypeAlias = Callable[[Rings, ShapeWriter, Key, Fingerprint | None, memoryview], int]


def take_eager(ring: Rings, shapes: ShapeReader, mailbox: Matcher, peer: int) -> tuple[int, int]:
    """Take the eager records at the front of ``ring`` (written by ``peer``) that have a posted
    receive or are to be dropped; returns how many records were taken and the bytes delivered.

    Raises:
        ValueError, ProtocolError: the ring holds nonsense (a shape never defined: the error the
            general reader would raise; the caller breaks the link).
    """
    taken = delivered = 0
    while True:
        rec = ring.peek()
        if rec is None:
            break
        raw, payload, rlen = rec
        if raw.nbytes != BIN_DATA.size or raw[0] != BIN_TAG:
            break
        key, fp = shapes.data(raw)
        n = payload.nbytes
        target = mailbox.match(peer, key, n, fp)
        if target is None:
            break  # (to be held: the general reader decides when, under the cap)
        if target is not DISCARD:
            target.buf[:] = payload
            delivered += n
            mailbox.complete(target, peer)
        ring.advance(rlen)
        taken += 1
    return taken, delivered


def write_eager(
    ring: Rings, shapes: ShapeWriter, key: Key, fp: Fingerprint | None, payload: memoryview
) -> int:
    """Write an eager data record whose fingerprint's shape ``shapes`` has numbered already:
    1 if written, 0 if the ring has no room now (nothing written), -1 if it must be written the
    general way (``ShmLink._write_data``: a new shape to define first, or a header only msgpack
    can carry)."""
    header = shapes.known(key, fp)
    if header is None:
        return -1
    return 1 if ring.try_write(header, payload) else 0


def reader_for(ring: Rings, mailbox: Matcher) -> EagerReader | None:
    """The compiled eager reader where ``ring`` and ``mailbox`` are both compiled, else None
    (the general reader takes every record)."""
    native = compiled("aiodist.transport._shm_eager")
    if native is not None and native.runs_on(ring, mailbox):
        fast: EagerReader = native.take_eager
        return fast
    return None


def writer_for(ring: Rings) -> EagerWriter | None:
    """The compiled eager writer where ``ring`` is compiled, else None (``_write_data`` writes)."""
    native = compiled("aiodist.transport._shm_eager")
    if native is not None and native.writes(ring):
        fast: EagerWriter = native.write_eager
        return fast
    return None
