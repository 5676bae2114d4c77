"""A smoke run of the torch-suite runner (``make test-torch-suite`` runs the whole selection).

Two tests of torch's suite at world size 2: one that passes on both runtimes, and one that
reaches into torch's internals (a ``ProcessGroup`` method), which must be reported failing on
aiodist with a one-line reason, in the printed counts and in the JSON summary.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("expecttest")  # torch's test harness needs it (make test-torch-suite installs it)

RUNNER = Path(__file__).resolve().parents[1] / "torch_suite" / "run.py"


@pytest.mark.timeout(120)
def test_runner_counts_and_reasons(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    args = [
        "--world-sizes",
        "2",
        "-k",
        "test_all_reduce_sum_async",
        "-k",
        "test_get_future",
        "--json",
        str(out),
    ]
    proc = subprocess.run(
        [sys.executable, str(RUNNER), *args], capture_output=True, text=True, timeout=110, check=True
    )
    summary = json.loads(out.read_text())["world_sizes"]["2"]
    assert summary["gloo"] == {"test_all_reduce_sum_async": "passed", "test_get_future": "passed"}
    assert summary["passed_on_gloo"] == 2 and summary["passed_on_aiodist"] == 1, proc.stdout
    reason = summary["aiodist_failures"]["test_get_future"]
    assert "allreduce" in reason and "\n" not in reason, reason
    assert "passed on aiodist: 1 of 2" in proc.stdout and "FAIL test_get_future" in proc.stdout
