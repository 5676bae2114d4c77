"""The mailbox's unexpected messages: what a finished, abandoned or resynced collective leaves."""

from __future__ import annotations

import asyncio

from aiodist.transport.base import COLL, P2P, Mailbox

KEY = (0, COLL, 5)


def _held_mailbox() -> tuple[Mailbox, list[int]]:
    box = Mailbox(0, asyncio.get_running_loop(), unexpected_cap=1 << 20)
    drained: list[int] = []
    box.on_drain = lambda: drained.append(box.unexpected_bytes)
    box.deliver(2, KEY, ["all_reduce", 5], memoryview(b"x" * 300), owned=False)  # arrives first
    box.deliver(1, KEY, ["all_reduce", 5], memoryview(b"y" * 200), owned=False)
    box.deliver(1, (0, P2P, 0), ["send"], memoryview(b"z" * 50), owned=False)  # another key: stays
    return box, drained


async def test_a_finished_collective_reports_the_first_late_sender_and_drops_every_one() -> None:
    """Data still held when its collective completed means the ranks disagreed: the first
    sender is reported, and nothing of that key stays counted against the cap (a reader
    paused at the cap is told)."""
    box, drained = _held_mailbox()
    assert box.unexpected_bytes == 550
    assert box.finish(KEY) == (2, ["all_reduce", 5])
    assert box.unexpected_bytes == 50
    assert drained[-1:] == [50]
    assert box.finish(KEY) is None


async def test_abandon_and_floor_drop_what_their_keys_hold() -> None:
    box, drained = _held_mailbox()
    box.abandon(KEY)
    assert box.unexpected_bytes == 50 and drained[-1:] == [50]
    box2, drained2 = _held_mailbox()
    box2.set_floor(0, 6)  # collectives below 6 are settled; point-to-point is not numbered
    assert box2.unexpected_bytes == 50 and drained2[-1:] == [50]
