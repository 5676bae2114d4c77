"""Ranks running different tasks or threads, and tasks racing on one group (FAULTS row 38).

Both sides of the contract, in real processes, on both faces and on the torch backend:

* programs whose ranks run different code, each task or thread alone on a group in a fixed
  order (a learner and its actors as different coroutines, threads named after their rank or
  role, executors numbered differently on each rank) run as they do under torch and gloo;
* tasks or threads of one program racing on one group (each rank scheduling them differently)
  raise ``CollectiveMismatchError`` rather than hand one another's data: that side is in
  tests/integration/test_tasks_sharing_a_group.py (tasks, the sync face's threads, torch's API).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.support.scripts import run_ranks

pytestmark = pytest.mark.timeout(120)

ASYNC_ROLES = textwrap.dedent(
    """
    import asyncio
    import numpy as np
    import aiodist as dist

    async def publish(shared, own):
        for step in range(5):
            w = np.full(8, float(step))
            await dist.broadcast(w, 0, group=shared)
            for sub in own:
                await dist.broadcast(w + 100, 0, group=sub)

    async def listen(shared, sub):
        got = []
        for _ in range(5):
            w = np.zeros(8)
            await dist.broadcast(w, 0, group=shared)
            got.append(w[0])
            await dist.broadcast(w, 0, group=sub)
            got.append(w[0])
        return got

    async def main():
        await dist.init_process_group("tcp", timeout=30)
        rank, size = dist.get_rank(), dist.get_world_size()
        shared = await dist.new_group()
        own = [await dist.new_group([0, a]) for a in range(1, size)]
        if rank == 0:
            await asyncio.create_task(publish(shared, own))
            print("RESULT published", flush=True)
        else:
            got = await asyncio.create_task(listen(shared, own[rank - 1]))
            print("RESULT", got == [v for s in range(5) for v in (s, s + 100)], flush=True)
        await dist.destroy_process_group()

    asyncio.run(main())
    """
)

THREADS = textwrap.dedent(
    """
    import sys, threading
    import concurrent.futures
    import torch

    how, face = sys.argv[1], sys.argv[2]
    if face == "backend":
        import datetime
        import aiodist.torch
        import torch.distributed as dist
        dist.init_process_group("aiodist", timeout=datetime.timedelta(seconds=30))
    else:
        import aiodist.sync as dist
        dist.init_process_group("gloo", timeout=30)
    rank, size = dist.get_rank(), dist.get_world_size()
    want = float(sum(range(1, size + 1)))
    outcomes = []

    def work(n):
        for _ in range(n):
            t = torch.full((4,), float(rank + 1))
            try:
                dist.all_reduce(t)
            except RuntimeError as exc:  # CollectiveMismatchError included
                outcomes.append(type(exc).__name__)
                continue
            outcomes.append("ok" if bool((t == want).all()) else f"wrong {t[0].item()}")

    if how in ("rank-named", "role-named"):
        # one thread per rank, named after the rank (or its role), alone on the world group
        name = f"comm-rank{rank}" if how == "rank-named" else ("learner" if rank == 0 else "actor")
        th = threading.Thread(target=work, args=(20,), name=name)
        th.start()
        th.join()
    else:  # executors: rank 0 made (and shut) one executor more before
        if rank == 0:
            concurrent.futures.ThreadPoolExecutor(1).submit(lambda: None).result()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(work, 20).result()
    print("RESULT", sorted(set(outcomes)), flush=True)
    dist.destroy_process_group()
    """
)


def _results(tmp_path: Path, script: str, args: list[str], size: int) -> list[str]:
    path = tmp_path / "job.py"
    path.write_text(script)
    ran = run_ranks(path, size, args=args, timeout=100)
    for r in ran:
        assert r.returncode == 0, r.stderr[-3000:]
    return [r.results()[0] for r in ran]


def test_a_learner_and_its_actors_as_different_coroutines_run(tmp_path: Path) -> None:
    results = _results(tmp_path, ASYNC_ROLES, [], 3)
    assert results == ["RESULT published", "RESULT True", "RESULT True"], results


@pytest.mark.parametrize("face", ["sync", "backend"])
@pytest.mark.parametrize("how", ["rank-named", "role-named", "executors"])
def test_threads_named_per_rank_or_numbered_per_process_run(tmp_path: Path, face: str, how: str) -> None:
    pytest.importorskip("torch")
    results = _results(tmp_path, THREADS, [how, face], 2)
    assert results == ["RESULT ['ok']"] * 2, results


async def test_a_task_check_that_is_no_choice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither the variable nor the argument is accepted and ignored: a bad value is an error
    (the variable's before any rendezvous)."""
    import aiodist as dist

    monkeypatch.setenv("AIODIST_TASK_CHECK", "sometimes")
    with pytest.raises(ValueError, match="AIODIST_TASK_CHECK must be one of auto, strict, off"):
        await dist.init_process_group("tcp", store=dist.HashStore(), rank=0, world_size=1)
    monkeypatch.setenv("AIODIST_TASK_CHECK", "off")
    await dist.init_process_group("tcp", store=dist.HashStore(), rank=0, world_size=1, timeout=10)
    try:
        with pytest.raises(ValueError, match="task_check must be one of 'auto', 'strict', 'off'"):
            await dist.new_group(task_check="sometimes")
        g = await dist.new_group(task_check="strict")
        assert g.origins.check == "strict"
        assert (await dist.new_group()).origins.check == "off"  # (the variable's, for the job)
    finally:
        await dist.destroy_process_group()
