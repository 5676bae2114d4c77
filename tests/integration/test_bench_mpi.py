"""The MPI peer of ``aiodist-bench --compare mpi``: where mpi4py and Open MPI are installed (the
``bench`` extra) it measures a tiny case beside aiodist, checked and in the same tables; where
MPI cannot run (no mpi4py, no mpiexec, a launcher that never starts its ranks) the bench says
why in one line and goes on with aiodist, within a bound.

Benchmarks are not tests: nothing here looks at the figures themselves.
"""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import sys
import time
from pathlib import Path

import pytest

from aiodist.bench import cli as bench
from aiodist.bench.mpi import MpiUnavailable, find_mpiexec, run_mpi_job
from aiodist.bench.worker import JobConfig


def _mpi_available() -> bool:
    if importlib.util.find_spec("mpi4py") is None:
        return False
    try:
        find_mpiexec()
    except MpiUnavailable:
        return False
    return True


TINY = [
    "-np", "2",
    "--faces", "async",
    "--ops", "all_reduce,sendrecv",
    "--sizes", "4K",
    "-r", "1", "-n", "2", "-w", "1",
    "--no-latency",
    "--no-progress",
]  # fmt: skip


@pytest.mark.timeout(180)
@pytest.mark.skipif(
    not _mpi_available(), reason="mpi4py and Open MPI's mpiexec are not installed (bench extra)"
)
def test_mpi_peer_measures_the_same_cases(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Open MPI's shared-memory segments go where this test can see that none is left behind.
    monkeypatch.setenv("OMPI_MCA_btl_sm_backing_directory", str(tmp_path))
    out = tmp_path / "bench.json"
    rc = bench.main([*TINY, "--compare", "mpi", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "# mpi: Open MPI" in text and "btl sm" in text, text
    assert "unavailable" not in text
    data = json.loads(out.read_text())
    assert "Open MPI" in data["meta"]["mpi"]["library"]
    (job,) = data["jobs"]
    assert "error" not in job and "mpi_error" not in job
    assert {r["op"] for r in job["rows"]} == {"all_reduce", "sendrecv"}
    for row in job["rows"]:
        mpi = row["impls"]["mpi"]
        assert mpi["wrong"] == 0, row
        assert mpi["time_us"] > 0
        assert row["vs_mpi"] == pytest.approx(mpi["time_us"] / row["impls"]["aiodist"]["time_us"])
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("sm_segment")] == []


def test_without_mpi4py_the_peer_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # what an environment without it looks like
    cfg = JobConfig(face="sync", nprocs=2, ops=("all_reduce",), sizes=(4,), compare=False)
    result = run_mpi_job(cfg)
    assert result["error"] == "mpi4py is not installed (pip install 'aiodist[bench]')"
    assert result["rows"] == {}


@pytest.mark.timeout(120)
def test_missing_mpiexec_is_reported_and_the_bench_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no" / "mpiexec"
    out = tmp_path / "bench.json"
    argv = [*TINY, "--compare", "mpi", "--mpiexec", str(missing), "--aiodist-transports", "tcp,shm"]
    rc = bench.main([*argv, "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.out
    if importlib.util.find_spec("mpi4py") is None:
        why = "mpi4py is not installed"
    else:
        why = f"mpiexec {str(missing)!r} is not an executable file"
    assert f"# mpi: unavailable, going on without it: {why}" in captured.out
    assert f"aiodist-bench: MPI peer unavailable: {why}" in captured.err
    # aiodist ran anyway, once told to use TCP only and once with its default transport.
    assert "# ===== aiodist-tcp async face (TCP only (AIODIST_SHM=0)), 2 ranks" in captured.out
    assert "# ===== aiodist async face (its default transport), 2 ranks" in captured.out
    jobs = json.loads(out.read_text())["jobs"]
    assert [j["aiodist"] for j in jobs] == ["aiodist-tcp", "aiodist"]
    for job in jobs:
        assert why in job["mpi_error"]
        assert {r["op"] for r in job["rows"]} == {"all_reduce", "sendrecv"}
        me = job["aiodist"]
        assert all(set(r["impls"]) == {me} and r["impls"][me]["wrong"] == 0 for r in job["rows"])


def _fake_launcher(tmp_path: Path, version: str) -> tuple[Path, Path]:
    """An executable that answers ``--version`` with ``version`` and otherwise never starts a rank."""
    pidfile = tmp_path / "launcher.pid"
    script = tmp_path / "mpiexec"
    script.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "--version" ]; then echo "{version}"; exit 0; fi\n'
        f"echo $$ > {pidfile}\n"
        "exec sleep 600\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, pidfile


@pytest.mark.timeout(60)
@pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None, reason="the launcher is tried only with mpi4py"
)
def test_a_launcher_that_never_starts_is_given_up_within_its_bound(tmp_path: Path) -> None:
    script, pidfile = _fake_launcher(tmp_path, "mpiexec (Open MPI) 5.0.11")
    cfg = JobConfig(face="sync", nprocs=2, ops=("all_reduce",), sizes=(4,), compare=False)
    t0 = time.monotonic()
    result = run_mpi_job(cfg, mpiexec=str(script), start_timeout=2.0)
    assert time.monotonic() - t0 < 20
    assert result["error"] == "MPI did not start 2 ranks within 2 s"
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the launcher was stopped, not left running


@pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None, reason="the launcher is tried only with mpi4py"
)
def test_an_mpiexec_that_is_not_open_mpi_is_refused(tmp_path: Path) -> None:
    script, pidfile = _fake_launcher(tmp_path, "HYDRA build details:")
    cfg = JobConfig(face="sync", nprocs=2, ops=("all_reduce",), sizes=(4,), compare=False)
    result = run_mpi_job(cfg, mpiexec=str(script))
    assert result["error"].startswith(f"{script} is not Open MPI's (HYDRA build details:)")
    assert not pidfile.exists()


def test_compare_and_transport_lists_are_checked() -> None:
    parse = bench._parser().parse_args
    assert parse([]).compare == () and parse([]).aiodist_transports == ("shm",)
    assert parse(["--compare", "gloo,mpi"]).compare == ("gloo", "mpi")
    assert parse(["--compare", "none"]).compare == ()
    assert parse(["--aiodist-transports", "tcp,shm"]).aiodist_transports == ("tcp", "shm")
    for bad in (["--compare", "nccl"], ["--aiodist-transports", "rdma"]):
        with pytest.raises(SystemExit):
            parse(bad)
