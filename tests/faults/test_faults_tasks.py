"""Ranks running different tasks or threads, and tasks racing on one group (FAULTS row 38).

Both sides of the contract, in real processes, on both faces and on the torch backend:

* programs whose ranks run different code, each task or thread alone on a group in a fixed
  order (a learner and its actors as different coroutines, threads named after their rank or
  role, executors numbered differently on each rank) run as they do under torch and gloo;
* threads of one program racing on one group (each rank scheduling them differently) raise
  ``CollectiveMismatchError`` rather than hand a thread another's data.
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

RACE = textwrap.dedent(
    """
    import datetime, threading
    import torch
    import torch.distributed as dist
    import aiodist.torch

    dist.init_process_group("aiodist", timeout=datetime.timedelta(seconds=30))
    rank, size = dist.get_rank(), dist.get_world_size()
    outcomes, lock = [], threading.Lock()
    rounds = 12
    turns = [[threading.Event() for _ in range(2)] for _ in range(rounds)]

    def order(i):  # every third round, rank 1 starts the workers in the other order
        return [0, 1] if (i + rank * (i % 3 == 0)) % 2 == 0 else [1, 0]

    def worker(k):
        for i in range(rounds):
            turns[i][k].wait(30)
            t = torch.full((4,), 1000.0 * (k + 1) + rank)
            work = dist.all_reduce(t, async_op=True)
            if order(i)[0] == k:
                turns[i][order(i)[1]].set()
            elif i + 1 < rounds:
                turns[i + 1][order(i + 1)[0]].set()
            try:
                work.wait()
            except RuntimeError as exc:
                with lock:
                    outcomes.append("mismatch" if "expected" in str(exc) else f"error {exc}")
                continue
            want = sum(1000.0 * (k + 1) + q for q in range(size))
            with lock:
                outcomes.append("ok" if bool((t == want).all()) else "wrong")

    threads = [threading.Thread(target=worker, args=(k,), name=f"worker-{k}") for k in range(2)]
    for th in threads:
        th.start()
    turns[0][order(0)[0]].set()
    for th in threads:
        th.join(60)
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


def test_threads_racing_on_torchs_api_get_a_mismatch_never_each_others_data(tmp_path: Path) -> None:
    """On the torch backend (the blocking face's threads race in
    tests/integration/test_tasks_sharing_a_group.py, and tasks in its memory twin)."""
    pytest.importorskip("torch")
    results = _results(tmp_path, RACE, [], 2)
    for line in results:
        assert "wrong" not in line and "error" not in line, results
        assert "mismatch" in line and "ok" in line, results
