"""A smoke run of the torch-suite runner (``make test-torch-suite`` runs the whole selection).

Three tests of torch's suite at world size 2, in all three modes: one collective that passes
everywhere; one that reaches into torch's internals (a ``ProcessGroup`` method), which must be
reported failing through ``aiodist.sync`` with a one-line reason, and which the suite itself
skips on a backend not named gloo, nccl or mpi (counted apart as skipped by the suite); and one
of torch's DDP tests, which runs in the backend mode only.
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


@pytest.mark.timeout(300)
def test_runner_counts_and_reasons(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    tests = ["test_all_reduce_sum_async", "test_get_future", "test_DistributedDataParallel_requires_grad"]
    args = ["--world-sizes", "2", "--json", str(out)] + [a for t in tests for a in ("-k", t)]
    proc = subprocess.run(
        [sys.executable, str(RUNNER), *args], capture_output=True, text=True, timeout=290, check=True
    )
    summary = json.loads(out.read_text())["world_sizes"]["2"]
    assert summary["gloo"] == dict.fromkeys(tests, "passed"), proc.stdout

    facade = summary["facade"]
    assert (facade["ran"], facade["passed"]) == (2, 1), proc.stdout  # DDP is not the facade's
    reason = facade["failures"]["test_get_future"]
    assert "allreduce" in reason and "\n" not in reason, reason
    assert "passed on aiodist.sync: 1 of 2" in proc.stdout and "FAIL test_get_future" in proc.stdout

    backend = summary["backend"]
    assert (backend["ran"], backend["passed"], backend["failures"]) == (3, 2, {}), proc.stdout
    assert backend["status"]["test_DistributedDataParallel_requires_grad"] == "passed"
    assert "only supported on" in backend["skipped_by_suite"]["test_get_future"]
    assert 'passed on backend "aiodist": 2 of 3 (1 skipped by the suite)' in proc.stdout
