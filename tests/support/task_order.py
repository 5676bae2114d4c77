"""Several asyncio tasks per rank starting collectives on one group, in orders chosen per rank.

Each task's input is distinct (task k on rank r contributes ``1000 * (k + 1) + r``) and every
task uses the same shapes, dtypes and roots, so an operation of task 0 paired with one of task
1 on another rank would exchange data without any other disagreement. ``run_tasks`` starts
each round's operations in the order a ``Schedule`` gives for this rank (a task starts its
operation, then hands the turn to the next), awaits them, and reports what each one saw:
the right result, a ``CollectiveMismatchError``, or a wrong value (never acceptable).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import numpy as np

import aiodist as dist

__all__ = ["OPS", "Outcome", "run_tasks", "schedule"]

Outcome = tuple[str, str]  # ("ok" | "mismatch" | "error" | "wrong", detail)
Schedule = Callable[[int, int, int], list[int]]  # (round, rank, tasks) -> order of the tasks
# What starting an operation leaves: its Work, a reading of its output, the right output.
Started = tuple[dist.Work, Callable[[], np.ndarray], np.ndarray]


def schedule(kind: str, seed: int = 0) -> Schedule:
    """``aligned``: one order on every rank; ``rotated``: rank r starts with task r; ``random``:
    a random order per round and rank (some rounds aligned, most not)."""

    def order(i: int, rank: int, n: int) -> list[int]:
        if kind == "aligned":
            return list(range(n))
        if kind == "rotated":
            return [(k + rank) % n for k in range(n)]
        tasks = list(range(n))
        random.Random(f"{seed}/{i}/{rank}").shuffle(tasks)
        return tasks

    return order


def _value(k: int, r: int) -> float:
    return 1000.0 * (k + 1) + r


def _all_reduce(g: Any, k: int, r: int, n: int, N: int) -> Started:
    t = np.full(N, _value(k, r))
    want = np.full(N, sum(_value(k, q) for q in range(n)))
    return dist.all_reduce(t, group=g), lambda: t, want


def _broadcast(g: Any, k: int, r: int, n: int, N: int) -> Started:
    t = np.full(N, _value(k, r))
    return dist.broadcast(t, 0, group=g), lambda: t, np.full(N, _value(k, 0))


def _reduce(g: Any, k: int, r: int, n: int, N: int) -> Started:
    t = np.full(N, _value(k, r))
    want = np.full(N, sum(_value(k, q) for q in range(n))) if r == 0 else t.copy()
    return dist.reduce(t, 0, group=g), lambda: t, want


def _all_gather(g: Any, k: int, r: int, n: int, N: int) -> Started:
    out = np.zeros(N * n)
    want = np.repeat([_value(k, q) for q in range(n)], N)
    return dist.all_gather_into_tensor(out, np.full(N, _value(k, r)), group=g), lambda: out, want


def _reduce_scatter(g: Any, k: int, r: int, n: int, N: int) -> Started:
    out = np.zeros(N)
    inp = np.concatenate([np.full(N, _value(k, r) + 0.5 * j) for j in range(n)])
    want = np.full(N, sum(_value(k, q) + 0.5 * r for q in range(n)))
    return dist.reduce_scatter_tensor(out, inp, group=g), lambda: out, want


def _all_to_all(g: Any, k: int, r: int, n: int, N: int) -> Started:
    out = np.zeros(N * n)
    inp = np.concatenate([np.full(N, _value(k, r) + 0.5 * j) for j in range(n)])
    want = np.concatenate([np.full(N, _value(k, q) + 0.5 * r) for q in range(n)])
    return dist.all_to_all_single(out, inp, group=g), lambda: out, want


def _gather(g: Any, k: int, r: int, n: int, N: int) -> Started:
    outs = [np.zeros(N) for _ in range(n)] if r == 0 else None
    work = dist.gather(np.full(N, _value(k, r)), outs, 0, group=g)
    if outs is None:
        return work, lambda: np.zeros(0), np.zeros(0)
    return work, lambda: np.concatenate(outs), np.repeat([_value(k, q) for q in range(n)], N)


def _scatter(g: Any, k: int, r: int, n: int, N: int) -> Started:
    out = np.zeros(N)
    ins = [np.full(N, _value(k, 0) + 0.5 * j) for j in range(n)] if r == 0 else None
    return dist.scatter(out, ins, 0, group=g), lambda: out, np.full(N, _value(k, 0) + 0.5 * r)


OPS = {
    "all_reduce": _all_reduce,
    "broadcast": _broadcast,
    "reduce": _reduce,
    "all_gather_into_tensor": _all_gather,
    "reduce_scatter_tensor": _reduce_scatter,
    "all_to_all_single": _all_to_all,
    "gather": _gather,
    "scatter": _scatter,
}


async def run_tasks(
    groups: list[Any],
    rank: int,
    size: int,
    op: str,
    order: Schedule,
    rounds: int,
    count: int = 4,
) -> list[Outcome]:
    """Run one task per group of ``groups`` on this rank (task k uses ``groups[k]``; they may
    all be one group), each starting ``rounds`` operations, round by round in the order
    ``order`` gives for this rank; return every operation's outcome, task by task.

    ``count``: elements per rank and task (large messages take other algorithms and paths).
    """
    n_tasks = len(groups)
    sequences = [order(i, rank, n_tasks) for i in range(rounds)]
    turns = [[asyncio.Event() for _ in range(n_tasks)] for _ in range(rounds)]

    async def task(k: int) -> list[Outcome]:
        seen: list[Outcome] = []
        for i, sequence in enumerate(sequences):
            await turns[i][k].wait()
            work, result, want = OPS[op](groups[k], k, rank, size, count)
            at = sequence.index(k)
            if at + 1 < n_tasks:
                turns[i][sequence[at + 1]].set()  # the next task starts its operation now
            elif i + 1 < rounds:
                turns[i + 1][sequences[i + 1][0]].set()  # every one of this round has started
            try:
                await work
            except dist.CollectiveMismatchError as exc:
                seen.append(("mismatch", str(exc)))
            except dist.DistError as exc:
                seen.append(("error", f"{type(exc).__name__}: {exc}"))
            else:
                got = result()
                if np.array_equal(got, want):
                    seen.append(("ok", ""))
                else:
                    at = int(np.flatnonzero(got != want)[0]) if got.shape == want.shape else 0
                    seen.append(("wrong", f"task {k} round {i}: [{at}] is {got[at]}, not {want[at]}"))
        return seen

    tasks = [asyncio.create_task(task(k)) for k in range(n_tasks)]
    turns[0][sequences[0][0]].set()
    per_task = await asyncio.gather(*tasks)
    return [o for seen in per_task for o in seen]
