"""A user's script run as every rank of a job: one interpreter per rank, stdout and stderr kept.

``aiodist.testing.spawn`` runs functions and returns their results; this runs whole programs,
for what only a program shows: what it prints on stderr (torch's C++ logging included), how it
exits, what its peers are told when it ends.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from aiodist.testing import free_port

__all__ = ["Ran", "run_ranks"]


@dataclass(frozen=True)
class Ran:
    """How one rank's interpreter ended."""

    rank: int
    returncode: int
    stdout: str
    stderr: str

    def results(self) -> list[str]:
        """The lines the script printed starting with "RESULT"."""
        return [ln for ln in self.stdout.splitlines() if ln.startswith("RESULT")]


def run_ranks(
    script: Path,
    world_size: int,
    *,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
) -> list[Ran]:
    """Run ``script`` as ranks 0..world_size-1 (env:// variables set); every rank's outcome.

    A rank still running after ``timeout`` seconds is killed, and the call fails naming it.
    """
    port = str(free_port())
    procs = []
    for rank in range(world_size):
        full = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        full.update(RANK=str(rank), WORLD_SIZE=str(world_size))
        full.update(env or {})
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args],
                env=full,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    ran = []
    deadline = time.monotonic() + timeout
    try:
        for rank, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
                raise AssertionError(
                    f"rank {rank} did not finish within {timeout} s:\n{err[-3000:]}"
                ) from None
            ran.append(Ran(rank, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return ran
