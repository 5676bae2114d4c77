"""A rank that sends and leaves at once (FAULTS row 34): receivers arriving later get the data.

A send completes once its data no longer needs the sender: in the kernel's socket buffer (TCP),
in the ring of shared memory (messages copied into it, whole or in pieces), or read by the
receiver (single-copy reads, whose send completes only then). Whatever completed must reach a
receiver that posts its receive after the sender has gone, whichever way it went: by
``destroy_process_group``, by the end of its program, or by an uncaught exception.

Every job sends one message of each size class, in order: 3,000,000 floats (single-copy, or
pieces through the ring under ``AIODIST_SHM=copy``), 262,145 (just over 1 MiB: the same), 16,385
(just over 64 KiB: a ring record that waits in the ring for its receive) and 100 (inline), then
leaves; the receiver starts receiving half a second later.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.support.scripts import run_ranks

pytestmark = pytest.mark.timeout(120)

SIZES = (3_000_000, 262_145, 16_385, 100)

ASYNC = textwrap.dedent(
    """
    import asyncio, sys
    import numpy as np
    import aiodist as dist

    SIZES, how = {sizes}, sys.argv[1]

    async def main():
        await dist.init_process_group("tcp", timeout=30)
        if dist.get_rank() == 0:
            for i, n in enumerate(SIZES):
                await dist.send(np.full(n, i + 1.0, np.float32), 1, tag=i)
            if how == "destroy":
                await dist.destroy_process_group()
            elif how == "raise":
                raise ValueError("boom after sending")
            return  # "exit": the program ends without destroy_process_group
        await asyncio.sleep(0.5)
        for i, n in enumerate(SIZES):
            buf = np.zeros(n, np.float32)
            await dist.recv(buf, 0, tag=i)
            print("RESULT", n, bool((buf == i + 1.0).all()), flush=True)
        await dist.destroy_process_group()

    asyncio.run(main())
    """
).format(sizes=SIZES)

SYNC = textwrap.dedent(
    """
    import sys, time
    import torch

    SIZES, how, face = {sizes}, sys.argv[1], sys.argv[2]
    if face == "sync":
        import aiodist.sync as dist
        dist.init_process_group("gloo", timeout=30)
    else:  # torch's own API on the registered backend
        import datetime
        import aiodist.torch
        import torch.distributed as dist
        dist.init_process_group("aiodist", timeout=datetime.timedelta(seconds=30))

    def move(buf, i):
        if face == "sync":
            (dist.send if dist.get_rank() == 0 else dist.recv)(buf, 0 if dist.get_rank() else 1, tag=i)
        else:
            dist.broadcast(buf, 0)

    if dist.get_rank() == 0:
        for i, n in enumerate(SIZES):
            move(torch.full((n,), i + 1.0), i)
        if how == "destroy":
            dist.destroy_process_group()
        elif how == "raise":
            raise ValueError("boom after sending")
        sys.exit(0)  # "exit": the script ends without destroy_process_group
    time.sleep(0.5)
    for i, n in enumerate(SIZES):
        buf = torch.zeros(n)
        move(buf, i)
        print("RESULT", n, bool((buf == i + 1.0).all()), flush=True)
    dist.destroy_process_group()
    """
).format(sizes=SIZES)

LEAVES = ("destroy", "exit", "raise")


def _check(tmp_path: Path, script: str, args: list[str], shm: str) -> None:
    path = tmp_path / "leave.py"
    path.write_text(script)
    r0, r1 = run_ranks(path, 2, args=args, env={"AIODIST_SHM": shm}, timeout=90)
    assert r1.returncode == 0, r1.stderr[-3000:]
    assert r1.results() == [f"RESULT {n} True" for n in SIZES], (r1.stdout, r1.stderr[-3000:])
    if args[0] == "raise":
        assert r0.returncode != 0 and "boom after sending" in r0.stderr
    else:
        assert r0.returncode == 0, r0.stderr[-3000:]


@pytest.mark.parametrize("shm", ["1", "copy", "0"], ids=["shm", "shm-copy", "tcp"])
@pytest.mark.parametrize("how", LEAVES)
def test_async_face_delivers_after_the_sender_left(tmp_path: Path, how: str, shm: str) -> None:
    _check(tmp_path, ASYNC, [how], shm)


@pytest.mark.parametrize("shm", ["1", "copy"], ids=["shm", "shm-copy"])
@pytest.mark.parametrize("how", LEAVES)
def test_sync_face_delivers_after_the_sender_left(tmp_path: Path, how: str, shm: str) -> None:
    pytest.importorskip("torch")
    _check(tmp_path, SYNC, [how, "sync"], shm)


@pytest.mark.parametrize("how", LEAVES)
def test_torch_backend_broadcast_reaches_ranks_after_the_root_left(tmp_path: Path, how: str) -> None:
    pytest.importorskip("torch")
    _check(tmp_path, SYNC, [how, "torch"], "1")


async def _abandoned_then_left(rank: int, size: int) -> str:
    """Ranks 0 and 2 disagree about reduce_scatter_tensor #0 (4 against 8 floats each), which
    sends each member its part directly; rank 2 abandons it, tells the others, and leaves.
    Rank 1 starts it only after rank 2 has left, so its first step sends to a rank gone."""
    import asyncio

    import numpy as np

    import aiodist as dist

    await dist.init_process_group("tcp", timeout=30)
    n = 8 if rank == 2 else 4
    out, inp = np.zeros(n, np.float32), np.ones(3 * n, np.float32)
    if rank == 1:
        try:
            await dist.recv(np.zeros(1, np.float32), 2, tag=7)  # returns once rank 2 has left
        except dist.DistNetworkError as exc:
            assert "has left the job" in str(exc), exc
    try:
        await dist.reduce_scatter_tensor(out, inp)
        outcome = "completed"
    except dist.DistError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    if rank == 2:
        await dist.destroy_process_group()
        return outcome
    buf = np.full(4, float(rank), np.float32)  # the group still carries 0 <-> 1 messages
    await (dist.send(buf, 1) if rank == 0 else dist.recv(buf, 0))
    await asyncio.sleep(0)
    await dist.destroy_process_group()
    return f"{outcome} | {buf.tolist()}"


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shm", "tcp"])
def test_a_rank_starting_what_a_leaver_abandoned_raises_its_notice(shm: str) -> None:
    """The notice of the member that abandoned the operation, not "rank 2 has left the job":
    the group stays usable between the members still there."""
    from aiodist.testing import spawn

    out = spawn(_abandoned_then_left, 3, env={"AIODIST_SHM": shm}, timeout=60)
    assert out[2].startswith("CollectiveMismatchError"), out
    for r in (0, 1):
        assert out[r].startswith("CollectiveMismatchError"), out
        assert out[r].endswith("| [0.0, 0.0, 0.0, 0.0]"), out
