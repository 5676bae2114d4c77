"""DETAIL mode's message: one operation's fingerprint in a fixed-size slot.

Every rank sends its fingerprint to every other member before a collective
(``aiodist.collectives.detail``). The slot has a fixed size so that each receive can be
posted before anything arrives::

    +-------------+----------------------------+--------------+
    | length u16  | fingerprint (msgpack list) | zero padding |   SLOT bytes in all
    | little-end. |                            |              |
    +-------------+----------------------------+--------------+
"""

from __future__ import annotations

import msgpack

from aiodist.wire.fingerprint import Fingerprint
from aiodist.wire.frames import ProtocolError

__all__ = ["SLOT", "decode_slot", "encode_slot"]

SLOT = 512  # bytes per encoded fingerprint
_LEN = 2


def encode_slot(fp: Fingerprint | None) -> memoryview:
    """``fp`` in a ``SLOT``-byte buffer (a fingerprint longer than the slot is cut, and its
    receivers will find it undecodable)."""
    raw = msgpack.packb(fp, use_bin_type=True)[: SLOT - _LEN]
    buf = bytearray(SLOT)
    buf[:_LEN] = len(raw).to_bytes(_LEN, "little")
    buf[_LEN : _LEN + len(raw)] = raw
    return memoryview(buf)


def decode_slot(buf: bytes | bytearray | memoryview) -> Fingerprint:
    """The fingerprint a slot holds (None is read as the empty list).

    Raises:
        ProtocolError: the slot is not ``SLOT`` bytes, its length overruns it, or it does not
            hold a msgpack list.
    """
    view = memoryview(buf).cast("B")
    if view.nbytes != SLOT:
        raise ProtocolError(f"malformed DETAIL fingerprint: a slot of {view.nbytes} bytes, not {SLOT}")
    n = int.from_bytes(view[:_LEN], "little")
    if n > SLOT - _LEN:
        raise ProtocolError(f"malformed DETAIL fingerprint: length {n} overruns the slot")
    try:
        fp = msgpack.unpackb(view[_LEN : _LEN + n], raw=False)
    except Exception as exc:  # msgpack raises a zoo of types (ValueError, ExtraData, StackError...)
        raise ProtocolError(f"malformed DETAIL fingerprint: {exc.__class__.__name__}") from None
    if fp is None:
        return []
    if type(fp) is not list:
        raise ProtocolError(f"malformed DETAIL fingerprint: a {type(fp).__name__}, not a list")
    return fp
