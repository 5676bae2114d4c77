"""A launched ``aiodist-bench`` job that loses a node: rank 0 says which rank was lost, saves what
it measured with the error, and exits non-zero; nothing hangs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.launcher import REPO, launcher_env, start_launcher

from aiodist.testing.procs import free_port

pytestmark = pytest.mark.timeout(120)

BENCH = str(Path(sys.executable).parent / "aiodist-bench")
MEMORY_LINE = "[rank 0]: # memory: RSS added by a 1 MiB all_reduce"


def test_rank_0_reports_a_lost_node_and_saves_what_it_measured(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    log0 = tmp_path / "node0.out"
    port = str(free_port())
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port]
    # The memory probe first (a line when it is done), then far more repetitions than run before
    # the node is stopped: the job is mid-way when it goes.
    bench = [BENCH, "--memory", "1M", "--ops", "all_reduce", "--sizes", "4K", "-r", "100000", "--no-latency"]
    bench.append("--no-progress")
    node1 = start_launcher(
        [*common, "--node-rank", "1", *bench], tmp_path, AIODIST_SECRET="lose-one", AIODIST_HOST_ID="node-b"
    )
    with open(log0, "w") as log:
        node0 = subprocess.Popen(
            [sys.executable, "-m", "aiodist.run", *common, "--node-rank", "0", *bench, "--json", str(out)],
            cwd=REPO,
            env=launcher_env(tmp_path, AIODIST_SECRET="lose-one", AIODIST_HOST_ID="node-a"),
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        deadline = time.monotonic() + 60
        while MEMORY_LINE not in log0.read_text():
            assert node0.poll() is None and node1.poll() is None, log0.read_text()
            assert time.monotonic() < deadline, log0.read_text()
            time.sleep(0.1)
        node1.terminate()  # node 1's launcher stops its worker (rank 1)
        node0.wait(timeout=60)
    finally:
        for proc in (node0, node1):
            proc.kill()
            proc.wait()
    text = log0.read_text()
    assert node0.returncode != 0, text
    assert re.search(r"^\[rank 0\]: # job failed: DistNetworkError: .*rank 1", text, re.M), text
    (job,) = json.loads(out.read_text())["jobs"]
    assert "rank 1" in job["error"]
    assert job["rows"] == [] and job["memory"]["aiodist"]  # what it measured before, saved
    assert job["placement"] == "2 hosts x 1 rank"
