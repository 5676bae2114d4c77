"""Launcher faults beyond tests/integration/test_launcher.py (FAULTS.md row 21: the port is reusable at once).

Rows 19 and 20 (a failing worker: summary, SIGTERM then SIGKILL, no orphans; a SIGKILLed
worker restarted once with the restart count in its environment) are covered by
tests/integration/test_launcher.py.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.faults import record
from support.launcher import REPO, SCRIPTS, assert_gone, launcher_env, start_launcher, wait_for

from aiodist.testing import free_port

pytestmark = pytest.mark.timeout(60)

JOB = SCRIPTS / "faults_job.py"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signalled_launcher_frees_the_port_at_once(tmp_path: Path, signum: signal.Signals) -> None:
    port = free_port()
    args = ["--nproc-per-node", "2", "--master-port", str(port), "--master-addr", "127.0.0.1"]
    first = start_launcher([*args, str(JOB)], tmp_path)
    try:
        wait_for([tmp_path / "ready_0", tmp_path / "ready_1"], first)  # rank 0 hosts the store on `port`
        first.send_signal(signum)
        first.communicate(timeout=20)
    finally:
        first.kill()
    assert first.returncode == 128 + signum
    # at once: a new job on the same port (its rank 0 binds it again)
    t0 = time.monotonic()
    second = subprocess.run(
        [sys.executable, "-m", "aiodist.run", *args, str(JOB), "--steps", "10"],
        cwd=REPO,
        env=launcher_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=40,
    )
    assert second.returncode == 0, second.stderr
    assert "[rank 0]: rank 0 of 2 finished 10 steps" in second.stdout.splitlines()
    record(21, "a new job on the same port right after the launcher's exit", time.monotonic() - t0)


def test_signalled_launcher_escalates_to_sigkill(tmp_path: Path) -> None:
    """Row 21: workers that ignore the forwarded signal are SIGKILLed after the grace period."""
    script = SCRIPTS / "faults_ignore_signals.py"
    launcher = start_launcher(["--nproc-per-node", "2", "--term-timeout", "0.5", str(script)], tmp_path)
    try:
        wait_for([tmp_path / "pid_0", tmp_path / "pid_1"], launcher)
        pids = [int((tmp_path / f"pid_{r}").read_text()) for r in range(2)]
        t0 = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=20)
        took = time.monotonic() - t0
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signal.SIGTERM, stderr
    assert "SIGKILL" in stderr, stderr
    assert 0.4 < took < 10, took
    assert_gone(pids)
