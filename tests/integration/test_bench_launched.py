"""``aiodist-bench`` launched: every rank started by a launcher (``aiodist-run`` on each of two
"nodes", Open MPI's ``mpiexec``), rank 0 printing the tables for all of them.

The two nodes are two launchers on 127.0.0.1 with ``--nnodes 2`` and node ranks 0 and 1, each
with its own ``AIODIST_HOST_ID``, so that aiodist (and the bench's record of the hosts) sees two
hosts. Benchmarks are not tests: nothing here looks at the figures themselves.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.launcher import REPO, launch, launcher_env, start_launcher

from aiodist.bench.mpi import MpiUnavailable, find_mpiexec
from aiodist.testing.procs import free_port

HAVE_TORCH = importlib.util.find_spec("torch") is not None
BENCH = str(Path(sys.executable).parent / "aiodist-bench")
TINY = ["--ops", "all_reduce,sendrecv", "--sizes", "4,4K", "-r", "1", "-n", "2", "-w", "1", "--no-progress"]


def _two_nodes(
    tmp_path: Path, nproc: int, command: list[str], timeout: float = 90
) -> tuple[subprocess.CompletedProcess[str], tuple[int, str, str]]:
    """Node 1's launcher in the background, node 0's to completion; both results."""
    port = str(free_port())
    common = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
    ]
    node1 = start_launcher(
        [*common, "--node-rank", "1", *command],
        tmp_path,
        AIODIST_SECRET="two-nodes",
        AIODIST_HOST_ID="node-b",
    )
    try:
        node0 = launch(
            [*common, "--node-rank", "0", *command],
            tmp_path,
            timeout=timeout,
            AIODIST_SECRET="two-nodes",
            AIODIST_HOST_ID="node-a",
        )
        out1, err1 = node1.communicate(timeout=timeout)
    finally:
        node1.kill()
        node1.wait()
    return node0, (node1.returncode, out1, err1)


def _check_rows(job: dict[str, Any], impls: set[str]) -> None:
    assert "error" not in job, job.get("error")
    assert {(r["op"], r["size"]) for r in job["rows"]} == {
        ("all_reduce", 4),
        ("all_reduce", 4096),
        ("sendrecv", 4),
        ("sendrecv", 4096),
    }
    for row in job["rows"]:
        assert set(row["impls"]) == impls, row
        for res in row["impls"].values():
            assert res["wrong"] == 0, row
            assert res["time_us"] > 0


@pytest.mark.timeout(150)
def test_two_aiodist_run_nodes_one_rank_each(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    compare = ["--compare", "gloo,mpi"] if HAVE_TORCH else ["--compare", "mpi"]
    node0, (rc1, out1, err1) = _two_nodes(
        tmp_path, 1, [BENCH, *TINY, "--no-latency", *compare, "--json", str(out)]
    )
    assert (node0.returncode, rc1) == (0, 0), node0.stdout + node0.stderr + out1 + err1
    text = node0.stdout
    # Rank 0 prints the tables, with the hosts, and says why MPI is not measured here.
    assert "[rank 0]: # aiodist-bench" in text and "launched by aiodist-run: 2 ranks" in text
    assert re.search(r"^\[rank 0\]: # hosts: 2 hosts x 1 rank: \S+ \[node-a\] \(127\.0\.0\.1", text, re.M), (
        text
    )
    assert re.search(r"^\[rank 0\]: #\s+size\s+count\s+type\s+redop\s+root\s+time\(us\)", text, re.M), text
    assert re.search(r"^\[rank 0\]:\s+4096\s+1024\s+float\s+sum\s+-1\s", text, re.M), text
    assert "# mpi: not measured: the ranks were started by aiodist-run, not by mpirun/mpiexec" in text
    # Rank 1 printed nothing: no table, no line at all.
    assert "[rank 1]:" not in out1 and "# all_reduce" not in out1 + err1, out1 + err1
    assert not list(tmp_path.glob("*.md")) and out.exists()

    data = json.loads(out.read_text())
    (job,) = data["jobs"]
    _check_rows(job, {"aiodist", "gloo"} if HAVE_TORCH else {"aiodist"})
    assert job["nprocs"] == 2 and job["face"] == "async" and job["launcher"] == "aiodist-run"
    assert job["placement"] == "2 hosts x 1 rank"
    assert [(h["host"], h["ranks"]) for h in job["hosts"]] == [("node-a", [0]), ("node-b", [1])]
    assert [r["rank"] for r in job["ranks"]] == [0, 1]
    assert "not by mpirun" in job["mpi_error"]
    launch_meta = data["meta"]["launch"]
    assert (launch_meta["launcher"], launch_meta["world_size"], launch_meta["placement"]) == (
        "aiodist-run",
        2,
        "2 hosts x 1 rank",
    )
    if HAVE_TORCH:
        assert all(h["gloo_ifnames"] == ["lo"] for h in job["hosts"])
    assert "2 hosts x 1 rank" in data["meta"]["title"]


@pytest.mark.timeout(150)
@pytest.mark.skipif(not HAVE_TORCH, reason="torchrun comes with torch")
def test_under_torchrun_aiodist_and_gloo_meet_at_its_store(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command = [
        *torchrun,
        "-m",
        "aiodist.bench",
        *TINY,
        "--no-latency",
        "--compare",
        "gloo",
        "--json",
        str(out),
    ]
    env = {k: v for k, v in launcher_env(tmp_path).items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "launched by torchrun: 2 ranks" in done.stdout
    assert "aiodist and gloo meet at torchrun's store" in done.stdout
    (job,) = json.loads(out.read_text())["jobs"]
    _check_rows(job, {"aiodist", "gloo"})


@pytest.mark.timeout(180)
def test_two_nodes_two_ranks_each_sync_face_as_a_module(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    md = tmp_path / "bench.md"
    command = [
        "-m",
        "aiodist.bench",
        *TINY,
        "--no-latency",
        "--faces",
        "sync",
        "--json",
        str(out),
        "--markdown",
        str(md),
    ]
    node0, (rc1, out1, err1) = _two_nodes(tmp_path, 2, command)
    assert (node0.returncode, rc1) == (0, 0), node0.stdout + node0.stderr + out1 + err1
    assert "[rank 1]:" not in node0.stdout and "[rank 2]:" not in out1 and "[rank 3]:" not in out1
    job = json.loads(out.read_text())["jobs"][0]
    _check_rows(job, {"aiodist"})
    assert (job["face"], job["nprocs"], job["placement"]) == ("sync", 4, "2 hosts x 2 ranks")
    assert [(h["host"], h["ranks"]) for h in job["hosts"]] == [("node-a", [0, 1]), ("node-b", [2, 3])]
    assert [r["local_rank"] for r in job["ranks"]] == [0, 1, 0, 1]
    assert "4 ranks on 2 hosts x 2 ranks" in node0.stdout
    assert "### 4 ranks (2 hosts x 2 ranks)" in md.read_text()


@pytest.mark.timeout(120)
@pytest.mark.skipif(not HAVE_TORCH, reason="gloo comes with torch")
@pytest.mark.skipif(not Path(BENCH).exists(), reason="the aiodist-bench console script is not installed")
def test_sync_face_beside_gloo_run_as_the_installed_command(tmp_path: Path) -> None:
    """The sync face's init, where torch is imported, would give torch.distributed a default group
    (AIODIST_TORCH_DEFAULT_GROUP=auto, the default); the bench keeps it for its gloo comparison,
    which a launched rank starts after aiodist. Launched as the docs show: --no-python aiodist-bench."""
    out = tmp_path / "bench.json"
    command = ["--no-python", "aiodist-bench", *TINY, "--no-latency", "--faces", "sync", "--compare", "gloo"]
    proc = launch(
        ["--standalone", "--nproc-per-node", "2", *command, "--json", str(out)],
        tmp_path,
        timeout=100,
        PATH=os.pathsep.join([str(Path(BENCH).parent), os.environ.get("PATH", "")]),
        AIODIST_TORCH_DEFAULT_GROUP="auto",  # what a user has, whatever this test run exported
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "beside torch gloo (same processes, alternating)" in proc.stdout
    (job,) = json.loads(out.read_text())["jobs"]
    _check_rows(job, {"aiodist", "gloo"})
    assert (job["face"], job["nprocs"], job["compare"]) == ("sync", 2, "gloo")


@pytest.mark.timeout(60)
def test_a_world_size_that_contradicts_the_launch_is_refused(tmp_path: Path) -> None:
    proc = launch(
        ["--standalone", "--nproc-per-node", "2", BENCH, "-np", "4", "--sizes", "4"], tmp_path, timeout=45
    )
    assert proc.returncode != 0
    assert (
        "[rank 0]: aiodist-bench: -np 4: aiodist-run started 2 ranks (RANK/WORLD_SIZE); in a launched job "
        "the launcher decides the world size" in proc.stderr
    ), proc.stderr
    assert "# aiodist-bench" not in proc.stdout  # refused before anything ran


def _mpiexec() -> str | None:
    if importlib.util.find_spec("mpi4py") is None:
        return None
    try:
        return find_mpiexec()
    except MpiUnavailable:
        return None


@pytest.mark.timeout(180)
@pytest.mark.skipif(
    _mpiexec() is None, reason="mpi4py and Open MPI's mpiexec are not installed (bench extra)"
)
def test_under_mpiexec_mpi_is_measured_in_the_same_processes(tmp_path: Path) -> None:
    mpiexec = _mpiexec()
    assert mpiexec is not None
    out = tmp_path / "bench.json"
    compare = "gloo,mpi" if HAVE_TORCH else "mpi"
    env = launcher_env(tmp_path)
    for name in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "AIODIST_HOST_ID"):
        env.pop(name, None)  # what mpiexec does not set: rank 0 sends it over MPI
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_btl_sm_backing_directory=str(tmp_path),  # where the test sees none is left
    )
    proc = subprocess.run(
        [mpiexec, "-n", "2", "--oversubscribe", "--bind-to", "none", sys.executable, "-m", "aiodist.bench",
         "-np", "2", *TINY, "--compare", compare, "--json", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    # One rank printed: one header, one table header per operation.
    assert text.count("# aiodist-bench") == 1 and text.count("# all_reduce\n") == 1, text
    assert "launched by mpirun (Open MPI): 2 ranks" in text
    assert "# MASTER_ADDR=127.0.0.1: chosen by rank 0, sent over MPI" in text
    assert "AIODIST_SECRET: generated by rank 0, sent over MPI" in text
    assert "beside torch gloo and MPI (same processes, alternating)" in text or not HAVE_TORCH
    data = json.loads(out.read_text())
    (job,) = data["jobs"]
    _check_rows(job, {"aiodist", "gloo", "mpi"} if HAVE_TORCH else {"aiodist", "mpi"})
    assert job["placement"] == "1 host x 2 ranks" and "mpi_error" not in job
    assert [r["op"] for r in job["latency"]] == ["all_reduce", "barrier", "pingpong", "stream"]
    assert all("mpi" in r["impls"] for r in job["latency"])
    assert "Open MPI" in data["meta"]["mpi"]["library"]
    assert data["meta"]["launch"]["launcher"] == "mpirun (Open MPI)"
    for row in job["rows"]:
        assert row["vs_mpi"] == pytest.approx(
            row["impls"]["mpi"]["time_us"] / row["impls"]["aiodist"]["time_us"]
        )
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("sm_segment")] == []
