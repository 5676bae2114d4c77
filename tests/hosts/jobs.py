"""Multi-host jobs on a bed: ``aiodist-run --nnodes N --node-rank K ...`` on each host.

Each node's launcher writes its stdout and stderr to files (``node<K>.out``, ``node<K>.err``
in the job's folder), so that nothing blocks on a full pipe however long a job runs; workers
report through files in ``$OUT_DIR`` (the same folder: the hosts share the file system).
"""

from __future__ import annotations

import itertools
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hosts.netbed import Bed, Host

__all__ = ["REPO", "SCRIPTS", "Job", "Node"]

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
# Variables of an outer job that must not leak into the launchers (they set their own).
_JOB_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "AIODIST_SECRET",
    "OMP_NUM_THREADS",
)
# Every bed has a network stack of its own, so fixed ports clash with nothing; each job of a
# test takes the next one (a store port just closed may linger in TIME_WAIT).
_PORTS = itertools.count(29500)


def launcher() -> list[str]:
    """The installed ``aiodist-run`` beside this Python (``python -m aiodist.run`` if none)."""
    script = Path(sys.executable).with_name("aiodist-run")
    return [str(script)] if script.exists() else [sys.executable, "-m", "aiodist.run"]


@dataclass
class Node:
    """One host's launcher."""

    rank: int
    host: Host
    proc: subprocess.Popen[bytes]
    out_path: Path
    err_path: Path

    @property
    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")


class Job:
    """``script`` on every host of ``bed`` (or the first ``nnodes``), ``nproc`` ranks per host.

    Args:
        out_dir: the job's folder (``$OUT_DIR`` of its workers, the launchers' output files).
        args: the script's arguments. env: added to every launcher's environment.
        launcher_args: more options for every launcher (``--monitor-interval 0.1``).
    """

    def __init__(
        self,
        bed: Bed,
        script: str | Path,
        *,
        nproc: int,
        out_dir: Path,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        nnodes: int | None = None,
        launcher_args: Sequence[str] = (),
    ) -> None:
        self.bed = bed
        self.hosts = bed.hosts[: nnodes or len(bed.hosts)]
        self.nproc = nproc
        self.out_dir = out_dir
        self.port = next(_PORTS)
        out_dir.mkdir(parents=True, exist_ok=True)
        base = {k: v for k, v in os.environ.items() if k not in _JOB_VARS and not k.startswith("PET_")}
        tests = str(REPO / "tests")
        base["PYTHONPATH"] = os.pathsep.join(p for p in (tests, base.get("PYTHONPATH", "")) if p)
        # Every node of a multi-node job must be given the same secret.
        base.update(OUT_DIR=str(out_dir), AIODIST_SECRET=secrets.token_hex(16), **(env or {}))
        self.env = base
        self.script = [str(SCRIPTS / script), *args]
        self.launcher_args = list(launcher_args)
        self.nodes: list[Node] = []

    @property
    def world_size(self) -> int:
        return len(self.hosts) * self.nproc

    def argv(self, node_rank: int) -> list[str]:
        """The launcher's command line on node ``node_rank``."""
        return [
            *launcher(), "--nnodes", str(len(self.hosts)), "--node-rank", str(node_rank),
            "--nproc-per-node", str(self.nproc), "--master-addr", self.hosts[0].addr,
            "--master-port", str(self.port), *self.launcher_args, *self.script,
        ]  # fmt: skip

    def start(self) -> Job:
        for k, host in enumerate(self.hosts):
            out, err = self.out_dir / f"node{k}.out", self.out_dir / f"node{k}.err"
            with out.open("wb") as o, err.open("wb") as e:
                proc = self.bed.run(host, self.argv(k), self.env, cwd=REPO, stdout=o, stderr=e)
            self.nodes.append(Node(k, host, proc, out, err))
        return self

    def wait(self, timeout: float, nodes: Sequence[int] | None = None) -> list[int]:
        """Wait for the launchers (``nodes``: those only) to exit; their exit codes.

        On timeout every launcher is killed and the test fails showing their output.
        """
        deadline = time.monotonic() + timeout
        chosen = [self.nodes[k] for k in nodes] if nodes is not None else self.nodes
        for node in chosen:
            try:
                node.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"the job did not end within {timeout} s\n{self.report()}") from None
        return [node.proc.returncode for node in chosen]

    def kill(self) -> None:
        for node in self.nodes:
            if node.proc.poll() is None:
                node.proc.kill()
            node.proc.wait()

    def report(self) -> str:
        """Every launcher's exit code, stdout and stderr tails, for a failing assertion."""
        parts = []
        for node in self.nodes:
            parts.append(
                f"--- node {node.rank} on {node.host.name} ({node.host.addr}): exit code {node.proc.poll()}\n"
                f"stdout:\n{node.stdout[-3000:]}\nstderr:\n{node.stderr[-6000:]}"
            )
        return "\n".join(parts)

    def wait_for_files(self, pattern: str, count: int, timeout: float) -> None:
        """Wait until ``count`` files match ``pattern`` in the job's folder; fail (showing the
        output) if the time runs out or a launcher exits first."""
        deadline = time.monotonic() + timeout
        while len(list(self.out_dir.glob(pattern))) < count:
            if any(node.proc.poll() is not None for node in self.nodes):
                raise AssertionError(
                    f"a launcher exited before {count} x {pattern} appeared\n{self.report()}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(
                    f"{count} x {pattern} did not appear within {timeout} s\n{self.report()}"
                )
            time.sleep(0.05)
