"""Ranks as real processes on loopback TCP, each bounded by a timeout.

``spawn(fn, world_size)`` starts ``world_size`` fresh interpreters (multiprocessing "spawn"),
sets MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE (and any extra environment) in each, runs
``fn(rank, world_size, *args)`` (a coroutine function runs on uvloop) and returns the
results in rank order. A rank that raises, dies or outlives the timeout makes ``spawn``
raise ``RankFailed`` with every rank's story; no process is left behind.
"""

from __future__ import annotations

import contextlib
import inspect
import multiprocessing as mp
import os
import queue
import secrets
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from aiodist.native import READ_AT_IMPORT
from aiodist.transport import shm_segment

__all__ = ["RankFailed", "free_port", "spawn", "started_with"]


class RankFailed(AssertionError):
    """One or more ranks of a spawned job failed; the message has each one's traceback."""


# (one at a time: two threads starting jobs at once must not see each other's variables)
_starting = threading.Lock()


@contextlib.contextmanager
def started_with(env: Mapping[str, str | None]) -> Iterator[None]:
    """While it lasts, the variables that aiodist reads as it is imported
    (``aiodist.native.READ_AT_IMPORT``) are as ``env`` says (None: removed), for the processes
    started meanwhile: a spawned process imports aiodist before its entry function can set
    them. The other variables of ``env`` are the entry function's to set."""
    with _starting:
        saved = {name: os.environ.get(name) for name in READ_AT_IMPORT}
        try:
            for name in READ_AT_IMPORT:
                if name in env:
                    value = env[name]
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def free_port() -> int:
    """An ephemeral TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    env: Mapping[str, str],
    args: Sequence[Any],
    results: Any,
) -> None:
    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    try:
        if inspect.iscoroutinefunction(fn):
            import uvloop

            out = uvloop.run(fn(rank, world_size, *args))
        else:
            out = fn(rank, world_size, *args)
        results.put((rank, True, out))
    except BaseException as exc:
        results.put((rank, False, f"{exc.__class__.__name__}: {exc}\n{traceback.format_exc()}"))


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
    expect_failure: Sequence[int] = (),
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; results in rank order.

    Args:
        fn: a module-level function (picklable); may be ``async def``.
        timeout: seconds for the whole job; past it every process is killed.
        env: extra environment for every rank (MASTER_PORT defaults to a free port).
        expect_failure: ranks allowed to die or raise (their result is None, or the error text).
    Raises:
        RankFailed: a rank raised, died, or the job timed out.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # AIODIST_SHM_JOB: the ranks' shared-memory segments carry it; what is left is swept at the end.
    full_env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "AIODIST_SHM_JOB": secrets.token_hex(8),
    }
    full_env.update(env or {})
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, full_env, tuple(args), results), daemon=True)
        for r in range(world_size)
    ]
    with started_with(full_env):
        for p in procs:
            p.start()
    out: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, value = results.get(timeout=0.1)
                out[rank] = (ok, value)
            except queue.Empty:
                # A process that died without reporting will never report.
                if all(not p.is_alive() for p in procs):
                    try:
                        while True:
                            rank, ok, value = results.get(timeout=0.5)
                            out[rank] = (ok, value)
                    except queue.Empty:
                        break
    finally:
        for p in procs:
            p.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        shm_segment.sweep(full_env["AIODIST_SHM_JOB"])
    problems = []
    for r, p in enumerate(procs):
        if r in out and out[r][0]:
            continue
        if r in expect_failure:
            continue
        if r in out:
            problems.append(f"rank {r} raised: {out[r][1]}")
        elif p.exitcode is None or (p.exitcode == -9 and time.monotonic() >= deadline):
            problems.append(f"rank {r} did not finish within {timeout} s")
        else:
            problems.append(f"rank {r} died with exit code {p.exitcode}")
    if problems:
        raise RankFailed("\n".join(problems))
    return [out[r][1] if r in out else None for r in range(world_size)]
