"""Dropped Works in real programs on the blocking face: a script that waits for what it starts
(blocking calls, ``async_op=True`` Works, isend/irecv, object collectives, new groups, DDP)
prints no report; one that drops a Work is told, on stderr, which operation it dropped.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from support.scripts import run_ranks

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(120)

SCRIPT = textwrap.dedent(
    """
    import gc, sys
    import numpy as np
    import torch
    import aiodist.sync as dist
    from aiodist.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", timeout=60)
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    x = np.ones(4, np.float32)

    # -- every operation's outcome taken: nothing is reported ----------------------------------
    dist.all_reduce(x)
    dist.all_reduce(torch.ones(3)[::2])                    # non-contiguous: staged and written back
    dist.all_reduce(x, async_op=True).wait()
    reqs = [dist.isend(x, peer), dist.irecv(np.zeros(4, np.float32), peer)]
    for r in reqs:
        r.wait()
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, np.zeros(4, np.float32), peer)])
    for w in works:
        w.wait()
    got = [None, None]
    dist.all_gather_object(got, {"rank": rank})
    objs = [rank]
    dist.broadcast_object_list(objs, src=0)
    sub = dist.new_group([0, 1])
    dist.all_reduce(x, group=sub)
    dist.monitored_barrier()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)), bucket_cap_mb=0.0001)
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
    dist.barrier()
    gc.collect()
    print("RESULT clean", flush=True)
    sys.stderr.write("--- dropped on purpose below ---\\n")
    sys.stderr.flush()

    # -- dropped: a success is warned about, a failure's error is logged ------------------------
    dist.all_reduce(x, async_op=True)                     # its Work dropped at once
    if rank == 0:
        dist.irecv(np.zeros(1), peer, tag=7)              # never sent: fails at destroy, unseen
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
    """
)


def test_a_script_that_waits_hears_nothing_and_one_that_drops_is_told(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    ran = run_ranks(script, 2, env={"OMP_NUM_THREADS": "1"}, timeout=100)
    for r in ran:
        assert r.returncode == 0, r.stderr
        assert r.results() == ["RESULT clean"], r.stdout
        clean, _, dropped = r.stderr.partition("--- dropped on purpose below ---")
        assert "never awaited" not in clean and "never retrieved" not in clean, clean
        warned = [ln for ln in dropped.splitlines() if "RuntimeWarning" in ln]
        assert len(warned) == 1 and "all_reduce #" in warned[0] and "was never awaited" in warned[0], dropped
        lost = "the error of recv from rank 1 (tag 7) was never retrieved"
        assert (lost in dropped) == (r.rank == 0), dropped
