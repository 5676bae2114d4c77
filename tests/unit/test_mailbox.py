"""The mailbox's unexpected messages: what a finished, abandoned or resynced collective leaves."""

from __future__ import annotations

import asyncio

from aiodist.transport.matching import COLL, DISCARD, P2P, Mailbox

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


async def test_a_withdrawn_message_puts_its_receive_back_first_in_line() -> None:
    """The sender withdrew the message a receive had matched (its send failed): the receive
    waits again ahead of those posted after it, so the sender's retry fills it."""
    box = Mailbox(0, asyncio.get_running_loop(), unexpected_cap=1 << 20)
    key = (0, P2P, 0)
    first, second = bytearray(3), bytearray(3)
    f1 = box.post(1, key, memoryview(first), ["send"])
    f2 = box.post(1, key, memoryview(second), ["send"])
    matched = box.match(1, key, 3, ["send"])
    assert matched is not None and matched is not DISCARD and matched.future is f1
    box.repost(matched)  # withdrawn
    box.deliver(1, key, ["send"], memoryview(b"abc"), owned=False)  # the retry
    box.deliver(1, key, ["send"], memoryview(b"def"), owned=False)
    assert (await f1, await f2) == (1, 1)
    assert bytes(first) == b"abc" and bytes(second) == b"def"


async def test_a_reposted_receive_takes_a_message_held_meanwhile() -> None:
    box = Mailbox(0, asyncio.get_running_loop(), unexpected_cap=1 << 20)
    key = (0, P2P, 0)
    buf = bytearray(2)
    fut = box.post(None, key, memoryview(buf), ["send"])
    matched = box.match(2, key, 2, ["send"])
    box.deliver(3, key, ["send"], memoryview(b"zz"), owned=False)  # held: no receive posted
    assert matched is not None and matched is not DISCARD
    box.repost(matched)
    assert await fut == 3 and bytes(buf) == b"zz" and box.unexpected_bytes == 0
