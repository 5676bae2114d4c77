"""Several hosts: a 2-node x 2-rank job across two network namespaces joined by a veth pair.

Each "node" is a network namespace with its own address (10.200.0.1 and 10.200.0.2) and runs
its own launcher (``python -m aiodist.run --nnodes 2 --node-rank K --master-addr 10.200.0.1``).
First a clean job; then node 1 dies (every process in its namespace is SIGKILLed): node 0's
workers fail with ``DistNetworkError`` naming a rank of node 1, and its launcher exits
non-zero. Needs root (``ip netns``); skipped, with the reason, where that is not permitted.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.faults import record

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "tests" / "support" / "launcher_scripts" / "faults_job.py"
ADDRS = ("10.200.0.1", "10.200.0.2")
PORT = 29533


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


@pytest.fixture
def nodes() -> Iterator[list[str]]:
    """Two network namespaces joined by a veth pair; removed afterwards whatever happens."""
    if shutil.which("ip") is None:
        pytest.skip("the ip command (iproute2) is not installed")
    tag = f"{os.getpid() % 100000}"
    names = [f"aiodist{tag}n0", f"aiodist{tag}n1"]
    created: list[str] = []
    try:
        for name in names:
            try:
                _ip("netns", "add", name)
            except subprocess.CalledProcessError as exc:
                pytest.skip(f"cannot create network namespaces here: {exc.stderr.strip()}")
            created.append(name)
        _ip(
            "link",
            "add",
            f"ad{tag}a",
            "netns",
            names[0],
            "type",
            "veth",
            "peer",
            "name",
            f"ad{tag}b",
            "netns",
            names[1],
        )
        for name, dev, addr in zip(names, (f"ad{tag}a", f"ad{tag}b"), ADDRS, strict=True):
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", name, "link", "set", dev, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield names
    finally:
        for name in created:
            _kill_namespace(name)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)


def _kill_namespace(name: str) -> None:
    """SIGKILL every process in namespace ``name`` (a node dying)."""
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=20).stdout
    for pid in pids.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def _launch(ns: str, node_rank: int, out: Path, *extra: str) -> subprocess.Popen[str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(OUT_DIR=str(out), AIODIST_SECRET="two-node-secret")
    cmd = [
        "ip", "netns", "exec", ns, sys.executable, "-m", "aiodist.run",
        "--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "2",
        "--master-addr", ADDRS[0], "--master-port", str(PORT), str(JOB), *extra,
    ]  # fmt: skip
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_nodes_then_one_dies(nodes: list[str], tmp_path: Path) -> None:
    # 1. a clean 2 x 2 job across the two namespaces
    clean = tmp_path / "clean"
    clean.mkdir()
    procs = [_launch(ns, k, clean, "--steps", "30") for k, ns in enumerate(nodes)]
    outs = [p.communicate(timeout=60) for p in procs]
    for p, (_stdout, stderr) in zip(procs, outs, strict=True):
        assert p.returncode == 0, stderr
    lines = outs[0][0].splitlines() + outs[1][0].splitlines()
    for rank in range(4):
        assert f"[rank {rank}]: rank {rank} of 4 finished 30 steps" in lines, lines
    # 2. node 1 dies in the middle of the job
    dying = tmp_path / "dying"
    dying.mkdir()
    procs = [_launch(ns, k, dying) for k, ns in enumerate(nodes)]
    try:
        deadline = time.monotonic() + 40
        while not all((dying / f"ready_{r}").exists() for r in range(4)):
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            assert time.monotonic() < deadline, "the job never got going"
            time.sleep(0.05)
        t0 = time.monotonic()
        _kill_namespace(nodes[1])
        _, stderr = procs[0].communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[0].returncode not in (0, None), stderr
    assert "DistNetworkError" in stderr, stderr
    assert "rank 2" in stderr or "rank 3" in stderr, stderr
    assert took < 15, took
    record("multi-node", "node 0's launcher exits non-zero after node 1 dies", took)
