"""A receive the blocking face posted on its caller's thread and left to the loop's thread
(``ProcessGroup.follow_recv``: matched to a message still arriving) is tracked as ``recv``
tracks its own: it completes with the sender, and its timeout fails it naming the receive.

Ranks as tasks over the in-memory transport (``run_memory_world``).
"""

from __future__ import annotations

import numpy as np
import pytest

import aiodist as dist
from aiodist.group import ProcessGroup
from aiodist.testing import run_memory_world
from aiodist.transport.matching import P2P

pytestmark = [pytest.mark.collectives, pytest.mark.timeout(60)]


async def test_a_followed_receive_completes_and_times_out_as_recv_does() -> None:
    async def fn(g: ProcessGroup) -> object:
        if g.rank == 0:
            await dist.send(np.arange(4, dtype=np.int32), 1, group=g, tag=3)
            await dist.barrier(group=g)
            return None
        buf = np.zeros(4, np.int32)
        fut = g.transport.recv(0, (g.gid, P2P, 3), memoryview(buf).cast("B"), ["send", "int32", 4])
        sender = await g.follow_recv(fut, 0, 3)
        await dist.barrier(group=g)
        lonely = g.transport.recv(
            0, (g.gid, P2P, 4), memoryview(np.zeros(1)).cast("B"), ["send", "float64", 1]
        )
        try:
            await g.follow_recv(lonely, 0, 4, timeout=0.2)
        except dist.DistTimeoutError as exc:
            return sender, buf.tolist(), str(exc)
        return sender, buf.tolist(), "no timeout"

    results = await run_memory_world(2, fn)
    sender, got, timed_out = results[1]
    assert (sender, got) == (0, [0, 1, 2, 3])
    assert "recv from rank 0 (tag 4)" in timed_out, timed_out
