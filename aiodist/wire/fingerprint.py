"""An operation's fingerprint, typed, and its reading for error messages.

On the wire (and in every message header) a fingerprint is a plain list, compared as a
list: ``[op, seq, dtype, count, root, redop]`` for a collective, ``[op, dtype, count]`` for
point-to-point. This class is the reading of that list, used only where a message is
written (mismatches, timeouts), so the data path pays nothing for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Fingerprint", "OpFingerprint"]

# A fingerprint as it travels and is compared: ``[op, seq, dtype, count, root, redop]`` or
# ``[op, dtype, count]``. Kept a plain list on the data path (built once per operation, compared
# with ``==``, packed by msgpack as it is); ``OpFingerprint`` is its reading.
Fingerprint = list[Any]


@dataclass(frozen=True, slots=True)
class OpFingerprint:
    """What ranks must agree on for one operation.

    Attributes:
        op: the operation's name ("all_reduce", "send").
        seq: its sequence number in its group (-1 for point-to-point).
        dtype: element type ("" where none applies, "object" for object collectives).
        count: element count (0 where none applies, -1 where it may differ per pair).
        root: the root's global rank (-1 where none applies).
        redop: the reduce op's name, or None.
    """

    op: str
    seq: int = -1
    dtype: str = ""
    count: int = 0
    root: int = -1
    redop: str | None = None

    @classmethod
    def from_wire(cls, fp: Any) -> OpFingerprint | None:
        """The fingerprint of a header's list (None for an untagged message); never raises."""
        if not fp:
            return None
        items = list(fp)
        if len(items) == 3:  # point-to-point: (op, dtype, count)
            return cls(str(items[0]), dtype=str(items[1] or ""), count=_int(items[2], 0))
        op, seq, dtype, count, root, redop = (items + [None] * 6)[:6]
        return cls(
            str(op),
            _int(seq, -1),
            str(dtype or ""),
            _int(count, 0),
            _int(root, -1),
            None if redop is None else str(redop),
        )

    def describe(self) -> str:
        """``all_reduce #5 (float32 x 10, sum)``, ``broadcast #2 (float32 x 4, root 1)``,
        ``barrier #0``; point-to-point: ``send of 10 x float32``."""
        if self.seq < 0:
            return f"{self.op} of {self.count} x {self.dtype}"
        details = []
        if self.dtype and self.count > 0:
            details.append(f"{self.dtype} x {self.count}")
        elif self.dtype and self.count < 0:  # counts may differ per pair (all_to_all)
            details.append(self.dtype)
        if self.root >= 0:
            details.append(f"root {self.root}")
        if self.redop:
            details.append(self.redop.lower())
        name = f"{self.op} #{self.seq}"
        return f"{name} ({', '.join(details)})" if details else name


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default
