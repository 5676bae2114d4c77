"""``aiodist.sync.isend``/``irecv`` return before the loop thread has started them.

What users rely on when a call no longer waits for its start: mistakes still raise at the call
(as in torch), messages between a pair keep their order across a burst, blocking calls after a
burst are not reordered ahead of it, and a posted receive whose peer leaves fails naming it.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from aiodist.testing import spawn

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(120)

BURST = 200


def _burst_job(rank: int, size: int) -> dict[str, Any]:
    import aiodist.sync as dist

    dist.init_process_group("tcp")
    peer = 1 - rank
    out: dict[str, Any] = {}
    if rank == 0:
        works = [dist.isend(torch.tensor([float(i)]), peer, tag=3) for i in range(BURST)]
        dist.send(torch.tensor([-1.0]), peer, tag=3)  # blocking, after the burst: must arrive last
        out["done"] = [w.wait() for w in works]
        out["name"] = works[0].name
    else:
        bufs = [torch.zeros(1) for _ in range(BURST + 1)]
        works = [dist.irecv(b, peer, tag=3) for b in bufs]
        out["sources"] = [w.wait() and w.source_rank() for w in works]
        out["values"] = [b.item() for b in bufs]
        out["name"] = works[0].name

    # A user's mistake raises at the call, before anything is posted.
    errors: dict[str, str] = {}
    for label, call in {
        "dst out of range": lambda: dist.isend(torch.ones(1), 7),
        "to self": lambda: dist.isend(torch.ones(1), rank),
        "sparse": lambda: dist.isend(torch.ones(4).to_sparse(), peer),  # (non-contiguous ones are copied)
        "bad tag": lambda: dist.irecv(torch.ones(1), peer, tag="x"),  # type: ignore[arg-type]
        "read-only output": lambda: dist.irecv(_read_only(), peer),
    }.items():
        try:
            call()
            errors[label] = "no error"
        except (ValueError, TypeError) as exc:
            errors[label] = type(exc).__name__
    out["errors"] = errors
    dist.barrier()

    dist.destroy_process_group()
    return out


def _loss_job(rank: int, size: int) -> str:
    import aiodist.sync as dist

    dist.init_process_group("tcp", timeout=60)
    if rank == 0:
        dist.barrier()
        os._exit(0)  # leaves without a word, with rank 1's receive posted
    pending = dist.irecv(torch.zeros(1), 0, tag=9)
    dist.barrier()
    try:
        pending.wait()
    except dist.DistError as exc:
        return str(exc)
    return "no error"


def _read_only() -> np.ndarray:
    a = np.zeros(1, np.float32)
    a.flags.writeable = False
    return a


def test_isend_irecv_burst_keeps_order_and_raises_mistakes_at_the_call() -> None:
    sender, receiver = spawn(_burst_job, 2, timeout=90)
    assert sender["done"] == [True] * BURST
    assert receiver["values"] == [float(i) for i in range(BURST)] + [-1.0]
    assert receiver["sources"] == [0] * (BURST + 1)
    assert "send to rank 1" in sender["name"]  # the Work takes the started operation's name
    assert "recv from rank 0" in receiver["name"]
    for errors in (sender["errors"], receiver["errors"]):
        assert errors == {
            "dst out of range": "DistValueError",
            "to self": "DistValueError",
            "sparse": "DistTypeError",
            "bad tag": "DistTypeError",
            "read-only output": "DistValueError",
        }


def test_posted_irecv_fails_naming_the_rank_that_left() -> None:
    _, message = spawn(_loss_job, 2, timeout=90, expect_failure=[0])
    assert "rank 0" in message, message
