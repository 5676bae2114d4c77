"""The calls-per-operation count of the repository's tooling (``tools/bench_calls.py``) runs and reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_calls.py"


def test_two_ranks_count_their_calls_and_the_run_is_saved(tmp_path: Path) -> None:
    out = tmp_path / "calls.json"
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--ops", "pingpong,broadcast", "-n", "100", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr
    pingpong, broadcast = json.loads(out.read_text())
    assert pingpong["op"] == "pingpong" and broadcast["op"] == "broadcast"
    for row in (pingpong, broadcast):
        assert all(0 < p < c for p, c in zip(row["python_calls"], row["calls"], strict=True)), row
    # a send and a receive on each rank: the same path both ways, up to the few idle turns of a
    # loop waiting for its peer (a loaded machine gave 2.2 calls per round over 20 rounds)
    assert abs(pingpong["calls"][0] - pingpong["calls"][1]) <= 0.05 * max(pingpong["calls"]), pingpong
    # the root only sends; the other rank receives and waits
    assert broadcast["calls"][0] < broadcast["calls"][1], broadcast
    calls, python = pingpong["calls"], pingpong["python_calls"]
    assert f"| pingpong | {calls[0]} | {calls[1]} | {python[0]} | {python[1]} |" in proc.stdout


def test_an_unknown_operation_is_refused() -> None:
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--ops", "all_reduce,scan"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "unknown operations ['scan']" in proc.stderr
