"""Fingerprints read per operation in error messages."""

from __future__ import annotations

import numpy as np
import pytest

import aiodist as dist
from aiodist.testing import run_memory_world
from aiodist.transport.base import describe_fingerprint
from aiodist.wire.fingerprint import OpFingerprint


@pytest.mark.parametrize(
    ("fp", "text"),
    [
        (["barrier", 0, "", 0, -1, None], "barrier #0"),
        (["all_reduce", 5, "float32", 10, -1, "SUM"], "all_reduce #5 (float32 x 10, sum)"),
        (["broadcast", 2, "float32", 4, 1, None], "broadcast #2 (float32 x 4, root 1)"),
        (["reduce", 3, "int64", 8, 0, "MAX"], "reduce #3 (int64 x 8, root 0, max)"),
        (["all_to_all", 7, "float64", -1, -1, None], "all_to_all #7 (float64)"),
        (["monitored_barrier", 1, "", 0, -1, None], "monitored_barrier #1"),
        (["send", "float32", 10], "send of 10 x float32"),
        (None, "an untagged message"),
    ],
)
def test_describe(fp: list[object] | None, text: str) -> None:
    assert describe_fingerprint(fp) == text


def test_from_wire_tolerates_a_foreign_list() -> None:
    assert OpFingerprint.from_wire(["x", "y", "z", "w"]) == OpFingerprint("x", -1, "z", 0)


async def test_barrier_against_all_reduce_reads_per_operation() -> None:
    async def body(g: dist.ProcessGroup) -> str:
        try:
            if g.rank == 0:
                await g.collective("barrier")
            else:
                await dist.all_reduce(np.zeros(10, np.float32), group=g)
        except dist.CollectiveMismatchError as exc:
            return str(exc)
        return "no error"

    msgs = await run_memory_world(2, body, timeout=10)
    for msg in msgs:
        assert "barrier #0" in msg and "( x 0)" not in msg, msg
        assert "all_reduce #0 (float32 x 10, sum)" in msg, msg
