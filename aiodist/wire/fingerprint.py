"""An operation's fingerprint, typed, and its reading for error messages.

On the wire (and in every message header) a fingerprint is a plain list, compared as a
list: ``[op, seq, dtype, count, root, redop, origin]`` for a collective, ``[op, dtype, count]``
for point-to-point. ``origin`` names the task or thread that started the collective, alike on
every rank (``aiodist.runtime.origin``): ranks that pair operations of different tasks disagree. This class is the reading of that list, used only where a message is
written (mismatches, timeouts), so the data path pays nothing for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ORDER_HINT", "Fingerprint", "OpFingerprint", "describe_all"]

# A fingerprint as it travels and is compared: ``[op, seq, dtype, count, root, redop, origin]`` or
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
        origin: the task or thread that started it ("" where none was sent).
    """

    op: str
    seq: int = -1
    dtype: str = ""
    count: int = 0
    root: int = -1
    redop: str | None = None
    origin: str = ""

    @classmethod
    def from_wire(cls, fp: Any) -> OpFingerprint | None:
        """The fingerprint of a header's list (None for an untagged message); never raises."""
        if not fp:
            return None
        items = list(fp)
        if len(items) == 3:  # point-to-point: (op, dtype, count)
            return cls(str(items[0]), dtype=str(items[1] or ""), count=_int(items[2], 0))
        op, seq, dtype, count, root, redop, origin = (items + [None] * 7)[:7]
        return cls(
            str(op),
            _int(seq, -1),
            str(dtype or ""),
            _int(count, 0),
            _int(root, -1),
            None if redop is None else str(redop),
            str(origin or ""),
        )

    def describe(self, with_origin: bool = False) -> str:
        """``all_reduce #5 (float32 x 10, sum)``, ``broadcast #2 (float32 x 4, root 1)``,
        ``barrier #0``; point-to-point: ``send of 10 x float32``. ``with_origin`` adds
        ``from task main/worker[1]``."""
        text = self._describe()
        return f"{text} from {_origin_phrase(self.origin)}" if with_origin else text

    def _describe(self) -> str:
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


ORDER_HINT = (
    "collectives on one group are matched across ranks by call order, and these were started by "
    "different tasks (or threads) in a different order on each rank; give each task its own group "
    "(new_group), or start them from one task (ranks that run different tasks on purpose, in a "
    'fixed order, can say so: new_group(..., task_check="off"))'
)
"""What to do when the only disagreement is the origin: said once, after the two descriptions."""


def describe_all(fps: list[Any]) -> tuple[list[str], bool]:
    """Readings of wire fingerprints that disagree, side by side.

    Returns:
        One reading per fingerprint (``"an untagged message"`` for None), with the origins
        named where they differ; and whether the origins are all that differs (then the
        readings are worth ``ORDER_HINT``).
    """
    typed = [OpFingerprint.from_wire(fp) for fp in fps]
    origins = {t.origin for t in typed if t is not None}
    with_origin = len(origins) > 1
    texts = ["an untagged message" if t is None else t.describe(with_origin) for t in typed]
    only_origin = with_origin and len({t._describe() for t in typed if t is not None}) == 1
    return texts, only_origin


def _origin_phrase(origin: str) -> str:
    if not origin:
        return "the main thread or an unnamed one"
    return origin if origin.startswith("thread ") else f"task {origin}"


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default
