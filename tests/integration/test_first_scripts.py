"""The README's "Your first script" examples print what the README says they print.

Each runs as a user would run it, under the launcher (``aiodist-run``, here ``python -m
aiodist.run``), as 2 real processes on loopback with a free port.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]


def _run(script: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, "-m", "aiodist.run", "--standalone", "--nproc-per-node", "2", f"examples/{script}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_hello_async_prints_the_sum_and_the_broadcast_on_every_rank() -> None:
    out = _run("hello_async.py")
    for rank in (0, 1):
        line = f"[rank {rank}]: rank {rank} of 2: all_reduce -> [3. 3. 3.], broadcast from rank 0 -> [7 7]"
        assert line in out, out


def test_hello_sync_prints_the_sum_on_every_rank() -> None:
    pytest.importorskip("torch")
    out = _run("hello_sync.py")
    lines = sorted(re.findall(r"^\[rank \d\]: .*$", out, re.M))
    assert lines == [
        "[rank 0]: rank 0 of 2: all_reduce -> [3.0, 3.0, 3.0]",
        "[rank 1]: rank 1 of 2: all_reduce -> [3.0, 3.0, 3.0]",
    ], out
