"""Several asyncio tasks (or threads) per rank starting collectives on one group, in real
processes, over TCP and over shared memory, small and large messages.

The orders differ from rank to rank on purpose, with the same shapes, dtypes and roots in
every task: each operation must return the right result or raise ``CollectiveMismatchError``
naming the tasks; never another task's data. One group per task is right in any order.
"""

from __future__ import annotations

import importlib.util
import re
import threading
from typing import Any

import numpy as np
import pytest
from support.task_order import OPS, run_tasks, schedule

import aiodist as dist
from aiodist.testing import spawn

pytestmark = pytest.mark.timeout(180)

HAVE_TORCH = importlib.util.find_spec("torch") is not None
SMALL = 4
LARGE = 1 << 18  # float64 elements: 2 MiB a task (pipelined rings, single-copy reads, reductions in turn)


async def _job(
    rank: int, size: int, tasks: int, count: int, own_groups: bool, backend: str = "tcp"
) -> dict[str, Any]:
    await dist.init_process_group(backend, timeout=60)
    kinds: dict[str, int] = {}
    bad: list[str] = []
    mismatch = ""
    groups = [await dist.new_group() for _ in range(tasks)] if own_groups else [None] * tasks
    for op in sorted(OPS):
        rounds = 6 if count == SMALL else 2
        for kind, detail in await run_tasks(
            groups, rank, size, op, schedule("random", seed=3), rounds, count
        ):
            kinds[kind] = kinds.get(kind, 0) + 1
            if kind in ("wrong", "error"):
                bad.append(f"{op}: {detail}")
            elif kind == "mismatch" and not mismatch:
                mismatch = detail
    await dist.destroy_process_group()
    return {"kinds": kinds, "bad": bad[:5], "mismatch": mismatch}


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize(("size", "tasks", "count"), [(2, 2, SMALL), (3, 3, SMALL), (2, 2, LARGE)])
def test_tasks_on_one_group_get_the_right_result_or_a_mismatch(
    transport: str, size: int, tasks: int, count: int
) -> None:
    env = {"AIODIST_SHM": "0" if transport == "tcp" else "1"}
    res = spawn(_job, size, args=(tasks, count, False), env=env, timeout=150)
    for r, out in enumerate(res):
        assert out["bad"] == [], f"rank {r}: {out['bad']}"
        assert out["kinds"].get("mismatch", 0) > 0, f"rank {r}: the orders differ, some pairs must disagree"
        assert out["kinds"].get("ok", 0) > 0, f"rank {r}: {out['kinds']}"
    text = next(out["mismatch"] for out in res if out["mismatch"])
    assert re.search(r"from task \S+/run_tasks\.task\[\d\] but rank \d sent", text), text
    assert "give each task its own group" in text, text


@pytest.mark.skipif(not HAVE_TORCH, reason="torch's gloo engine needs torch")
def test_tasks_on_torchs_engine_get_the_right_result_or_a_mismatch() -> None:
    """torch's engine carries the data without a fingerprint: the members check theirs alongside."""
    res = spawn(_job, 3, args=(3, SMALL, False, "torch-gloo"), timeout=150)
    for r, out in enumerate(res):
        assert out["bad"] == [], f"rank {r}: {out['bad']}"
        assert out["kinds"].get("mismatch", 0) > 0 and out["kinds"].get("ok", 0) > 0, out["kinds"]
    text = next(out["mismatch"] for out in res if out["mismatch"])
    assert "fingerprint check on rank" in text and "give each task its own group" in text, text


def test_one_group_per_task_is_right_in_any_order() -> None:
    res = spawn(_job, 3, args=(3, SMALL, True), timeout=150)
    for out in res:
        assert out["bad"] == [] and set(out["kinds"]) == {"ok"}, out


def _threads_job(rank: int, size: int, own_groups: bool, api: str = "sync") -> dict[str, Any]:
    """Two threads per rank, each starting all_reduce on the sync face (or torch's own API on the
    backend "aiodist"), rank 1 in the other order."""
    if api == "torch":
        import datetime

        import torch.distributed as sdist

        import aiodist.torch  # noqa: F401  (registers the backend)

        sdist.init_process_group("aiodist", timeout=datetime.timedelta(seconds=60))
        mismatch: Any = RuntimeError  # (torch's error type; the message is aiodist's)
    else:
        import aiodist.sync as sdist

        sdist.init_process_group("gloo", timeout=60)
        mismatch = sdist.CollectiveMismatchError
    groups = [sdist.new_group(), sdist.new_group()] if own_groups else [None, None]
    rounds = 20
    turns = [[threading.Event() for _ in range(2)] for _ in range(rounds)]
    outcomes: list[str] = []
    lock = threading.Lock()

    def order(i: int) -> list[int]:
        return [0, 1] if (i + rank * (i % 3 == 0)) % 2 == 0 else [1, 0]

    def worker(k: int) -> None:
        for i in range(rounds):
            seq = order(i)
            turns[i][k].wait(60)
            t = np.full(4, 1000.0 * (k + 1) + rank)
            if api == "torch":
                import torch

                t = torch.from_numpy(t)  # (torch's API takes tensors only)
            work = sdist.all_reduce(t, group=groups[k], async_op=True)
            at = seq.index(k)
            if at == 0:
                turns[i][seq[1]].set()
            elif i + 1 < rounds:
                turns[i + 1][order(i + 1)[0]].set()
            try:
                work.wait()
            except mismatch as exc:
                with lock:
                    outcomes.append(f"mismatch {exc}" if "but rank" in str(exc) else f"error {exc}")
                continue
            want = sum(1000.0 * (k + 1) + q for q in range(size))
            with lock:
                outcomes.append(
                    "ok" if bool((t == want).all()) else f"wrong: expected {want}, received {t[0]}"
                )

    threads = [threading.Thread(target=worker, args=(k,), name=f"worker-{k}") for k in range(2)]
    for th in threads:
        th.start()
    turns[0][order(0)[0]].set()
    for th in threads:
        th.join(120)
    sdist.destroy_process_group()
    kinds: dict[str, int] = {}
    for o in outcomes:
        kinds[o.split(" ")[0].rstrip(":")] = kinds.get(o.split(" ")[0].rstrip(":"), 0) + 1
    return {"kinds": kinds, "wrong": [o for o in outcomes if o.startswith("wrong")],
            "mismatch": next((o for o in outcomes if o.startswith("mismatch")), "")}  # fmt: skip


@pytest.mark.skipif(not HAVE_TORCH, reason="torch's API needs torch")
def test_threads_on_torchs_api_get_the_right_result_or_a_mismatch() -> None:
    """torch.distributed itself on the backend "aiodist": the same rule as the sync face."""
    for out in spawn(_threads_job, 2, args=(False, "torch"), timeout=120):
        assert out["wrong"] == [] and "error" not in out["kinds"], out
        assert out["kinds"].get("mismatch", 0) > 0 and out["kinds"].get("ok", 0) > 0, out["kinds"]
        assert "from thread worker-" in out["mismatch"], out["mismatch"]


def test_threads_of_the_sync_face_get_the_right_result_or_a_mismatch() -> None:
    res = spawn(_threads_job, 2, args=(False,), timeout=120)
    for out in res:
        assert out["wrong"] == [], out["wrong"]
        assert out["kinds"].get("mismatch", 0) > 0 and out["kinds"].get("ok", 0) > 0, out["kinds"]
    text = next(out["mismatch"] for out in res if out["mismatch"])
    assert "from thread worker-0" in text and "from thread worker-1" in text, text
    own = spawn(_threads_job, 2, args=(True,), timeout=120)
    for out in own:
        assert out["kinds"] == {"ok": 40}, out
