"""The launchers ``aiodist.run`` and ``aiodist.launch``, run as real subprocesses (FAULTS rows 19-21).

Worker scripts live in ``tests/support/launcher_scripts``; they report through files in ``$OUT_DIR``.
Every test is bounded by a pytest-timeout mark and by the subprocess timeouts below.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from support.launcher import RUN_TIMEOUT, SCRIPTS, assert_gone, launch, records, start_launcher, wait_for

from aiodist._launcher.config import STDERR, STDOUT, parse_config, parse_stream_spec
from aiodist._launcher.env import resolve_secret
from aiodist._launcher.relay import LineSplitter, Tail
from aiodist._launcher.summary import describe_exit

pytestmark = pytest.mark.timeout(30)


# -- environment contract ---------------------------------------------------------------------


def test_env_contract_single_node(tmp_path: Path) -> None:
    # As if this launcher ran inside a torchrun worker: what torchrun told it must not reach its workers.
    args = ["--nproc-per-node", "2", "--standalone", str(SCRIPTS / "env_dump.py")]
    proc = launch(args, tmp_path, TORCHELASTIC_USE_AGENT_STORE="True")
    assert proc.returncode == 0, proc.stderr
    dumped = records(tmp_path)
    assert sorted(dumped) == [0, 1]
    envs = [dumped[r]["env"] for r in (0, 1)]
    for rank, env in enumerate(envs):
        assert env["RANK"] == env["LOCAL_RANK"] == env["ROLE_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "2"
        assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == ("0", "1")
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["TORCHELASTIC_RESTART_COUNT"] == env["AIODIST_RESTART_COUNT"] == "0"
        assert env["OMP_NUM_THREADS"] == "1"
        # Rank 0 hosts the store, not the launcher.
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] and int(envs[0]["MASTER_PORT"]) > 0
    # A fresh secret, generated once and shared by every worker.
    assert re.fullmatch(r"[0-9a-f]{64}", envs[0]["AIODIST_SECRET"])
    assert envs[0]["AIODIST_SECRET"] == envs[1]["AIODIST_SECRET"]
    assert "OMP_NUM_THREADS=1" in proc.stderr


def test_user_secret_and_omp_threads_are_kept(tmp_path: Path) -> None:
    proc = launch(
        ["--nproc_per_node=2", str(SCRIPTS / "env_dump.py")],
        tmp_path,
        AIODIST_SECRET="s3cret",
        OMP_NUM_THREADS="3",
    )
    assert proc.returncode == 0, proc.stderr
    for record in records(tmp_path).values():
        assert record["env"]["AIODIST_SECRET"] == "s3cret"
        assert record["env"]["OMP_NUM_THREADS"] == "3"
        assert record["env"]["MASTER_PORT"] == "29500"


def test_multi_node_rank_math(tmp_path: Path) -> None:
    args = ["--nnodes", "2", "--node_rank", "1", "--nproc-per-node", "2", "--master-addr", "10.1.2.3"]
    proc = launch(
        [*args, "--master_port", "29555", str(SCRIPTS / "env_dump.py")], tmp_path, AIODIST_SECRET="k"
    )
    assert proc.returncode == 0, proc.stderr
    dumped = records(tmp_path)
    assert sorted(dumped) == [2, 3]
    for rank, record in dumped.items():
        env = record["env"]
        assert env["LOCAL_RANK"] == str(rank - 2)
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("4", "2")
        assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == ("1", "2")
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.1.2.3", "29555")
        assert env["AIODIST_SECRET"] == "k"


def test_multi_node_without_secret_warns_and_generates_none(tmp_path: Path) -> None:
    proc = launch(["--nnodes", "2", "--node-rank", "0", str(SCRIPTS / "env_dump.py")], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "AIODIST_SECRET is not set" in proc.stderr
    assert records(tmp_path)[0]["env"]["AIODIST_SECRET"] is None


# -- output -----------------------------------------------------------------------------------


def test_output_is_prefixed_per_rank(tmp_path: Path) -> None:
    proc = launch(["--nproc-per-node", "2", str(SCRIPTS / "env_dump.py")], tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for rank in (0, 1):
        assert f"[rank {rank}]: hello from rank {rank}" in lines
        # The partial last line is kept, on a line of its own.
        assert f"[rank {rank}]: no newline at the end" in lines
    assert all(line.startswith("[rank ") for line in lines)


def test_log_dir_layout(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    proc = launch(
        ["--nproc-per-node", "2", "--log-dir", str(logs), "--run-id", "job7", str(SCRIPTS / "env_dump.py")],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        directory = logs / "job7" / "attempt_0" / str(rank)
        # Raw bytes, no prefix.
        assert (directory / "stdout.log").read_text() == f"hello from rank {rank}\nno newline at the end"
        assert (directory / "stderr.log").read_text() == ""
    assert "[rank 0]: hello from rank 0" in proc.stdout


def test_redirects_keep_stdout_off_the_console(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    args = ["--nproc-per-node", "2", "--log-dir", str(logs), "--run-id", "r", "--redirects", "1"]
    proc = launch([*args, str(SCRIPTS / "env_dump.py")], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "hello" not in proc.stdout
    assert "hello from rank 1" in (logs / "r" / "attempt_0" / "1" / "stdout.log").read_text()
    assert not (logs / "r" / "attempt_0" / "1" / "stderr.log").exists()


def test_tee_without_log_dir_and_rank_filter(tmp_path: Path) -> None:
    args = ["--nproc-per-node", "2", "--tee", "3", "--local-ranks-filter", "1", str(SCRIPTS / "env_dump.py")]
    proc = launch(args, tmp_path, TMPDIR=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [
        "[rank 1]: hello from rank 1",
        "[rank 1]: no newline at the end",
    ]
    match = re.search(r"worker logs: (\S+)", proc.stderr)
    assert match, proc.stderr
    assert (
        (Path(match.group(1)) / "attempt_0" / "0" / "stdout.log").read_text().startswith("hello from rank 0")
    )


def test_module_and_no_python(tmp_path: Path) -> None:
    proc = launch(["--nproc-per-node", "2", "-m", "tests.support.launcher_scripts.env_dump"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(records(tmp_path)) == [0, 1]
    proc = launch(
        ["--nproc-per-node", "2", "--no-python", "sh", "-c", 'echo "r=$RANK/$WORLD_SIZE"'], tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["[rank 0]: r=0/2", "[rank 1]: r=1/2"]


@pytest.mark.timeout(60)
def test_real_job_rendezvous_through_rank_zero(tmp_path: Path) -> None:
    """The launcher starts no store: rank 0's init_process_group hosts it at MASTER_ADDR:MASTER_PORT."""
    pytest.importorskip("aiodist.sync")
    proc = launch(["--standalone", "--nproc-per-node", "2", str(SCRIPTS / "rendezvous.py")], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"[rank {rank}]: joined as {rank} of 2" in proc.stdout.splitlines()


# -- failures (FAULTS 19, 20) -----------------------------------------------------------------


def _summary_pid(stderr: str) -> int:
    match = re.search(r"^\s+pid\s+: (\d+)$", stderr, re.MULTILINE)
    assert match, stderr
    return int(match.group(1))


def test_failing_worker_stops_the_others(tmp_path: Path) -> None:
    started = time.monotonic()
    proc = launch(
        ["--nproc-per-node", "2", str(SCRIPTS / "fail_one.py")], tmp_path, AIODIST_TERM_TIMEOUT="10"
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 1
    summary = proc.stderr[proc.stderr.index("worker group failed") :]
    assert re.search(r"rank\s+: 1 \(local_rank 1", summary), summary
    assert "exit code 1" in summary
    assert "ValueError: boom from rank 1" in summary and "Traceback (most recent call last)" in summary
    pid_0 = int((tmp_path / "pid_0").read_text())
    assert _summary_pid(summary) not in (pid_0, os.getpid())
    assert f"rank 0 (local_rank 0, pid {pid_0}): stopped by the launcher (SIGTERM)" in summary
    # SIGTERM ended rank 0 well before the 10 s grace period; neither it nor its child survives.
    assert elapsed < 8
    assert_gone([int((tmp_path / name).read_text()) for name in ("pid_0", "child_0")])


def test_worker_ignoring_sigterm_gets_sigkill(tmp_path: Path) -> None:
    args = ["--nproc-per-node", "2", "--term-timeout", "0.5", str(SCRIPTS / "fail_one.py"), "--ignore-term"]
    proc = launch(args, tmp_path)
    assert proc.returncode == 1
    assert "after SIGTERM; sending SIGKILL" in proc.stderr
    assert_gone([int((tmp_path / name).read_text()) for name in ("pid_0", "child_0")])


def test_sigkilled_worker_restarts_once(tmp_path: Path) -> None:
    proc = launch(["--nproc-per-node", "2", "--max-restarts", "1", str(SCRIPTS / "self_kill.py")], tmp_path)
    assert proc.returncode == 1
    markers = sorted(p.name for p in tmp_path.glob("attempt_*"))
    assert markers == ["attempt_0_rank_0", "attempt_0_rank_1", "attempt_1_rank_0", "attempt_1_rank_1"]
    assert proc.stderr.count("restarting it (restart 1 of 1)") == 1
    summary = proc.stderr[proc.stderr.index("worker group failed (") :]
    assert "restarts used: 1 of 1" in summary
    assert "killed by SIGKILL (exit code -9)" in summary
    assert re.search(r"rank\s+: 0 \(local_rank 0", summary), summary
    # Rank 0 died by a signal the launcher did not send; rank 1 was waiting and had to be stopped.
    assert re.search(r"^Root cause: rank 0 \(", summary, re.MULTILINE), summary
    assert re.search(
        r"^  rank 1 \(local_rank 1, pid \d+\): stopped by the launcher \(SIGTERM\)", summary, re.M
    )


def test_restart_then_success(tmp_path: Path) -> None:
    proc = launch(["--nproc-per-node", "2", "--max_restarts=2", str(SCRIPTS / "flaky.py")], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "[rank 0]: rank 0 attempt 1" in proc.stdout.splitlines()
    assert "attempt 2" not in proc.stdout
    assert "rank 0 (local_rank 0, pid" in proc.stderr and "exit code 3" in proc.stderr


def test_missing_executable(tmp_path: Path) -> None:
    proc = launch(["--no-python", str(tmp_path / "no-such-program")], tmp_path)
    assert proc.returncode == 2
    assert "no-such-program: no such executable" in proc.stderr


# -- launcher signals (FAULTS 21) ---------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_launcher_signal_is_forwarded(tmp_path: Path, signum: signal.Signals) -> None:
    launcher = start_launcher(["--nproc-per-node", "2", str(SCRIPTS / "wait_signal.py")], tmp_path)
    try:
        wait_for([tmp_path / "ready_0", tmp_path / "ready_1"])
        launcher.send_signal(signum)
        _, stderr = launcher.communicate(timeout=RUN_TIMEOUT)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signum
    for rank in (0, 1):
        assert (tmp_path / f"got_{signum.name}_{rank}").exists()
    assert f"received {signum.name}" in stderr


# -- legacy launcher ----------------------------------------------------------------------------


@pytest.mark.parametrize("use_env", [False, True])
def test_legacy_launch_local_rank_argument(tmp_path: Path, use_env: bool) -> None:
    flags = ["--use-env"] if use_env else []
    args = ["--nproc_per_node", "2", *flags, str(SCRIPTS / "env_dump.py"), "--foo", "1"]
    proc = launch(args, tmp_path, module="aiodist.launch")
    assert proc.returncode == 0, proc.stderr
    for rank, record in records(tmp_path).items():
        expected = ["--foo", "1"] if use_env else [f"--local_rank={rank}", "--foo", "1"]
        assert record["argv"] == expected
        assert record["env"]["LOCAL_RANK"] == str(rank)


# -- command line -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nnodes", "1:2"], "elastic"),
        (["--nnodes", "2", "--node-rank", "2"], "out of range"),
        (["--standalone", "--nnodes", "2"], "single node"),
        (["--nproc-per-node", "many"], "--nproc-per-node"),
        (["--tee", "4"], "--tee"),
    ],
)
def test_bad_command_line(tmp_path: Path, args: list[str], message: str) -> None:
    proc = launch([*args, str(SCRIPTS / "env_dump.py")], tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert not records(tmp_path)


def test_parse_config_details() -> None:
    config = parse_config(
        ["--nproc-per-node", "cpu", "--nnodes", "3:3", "--node-rank", "2", str(SCRIPTS / "env_dump.py")],
        prog="t",
    )
    assert config.nproc_per_node == (os.cpu_count() or 1)
    assert (config.nnodes, config.world_size, config.global_rank(1)) == (
        3,
        3 * config.nproc_per_node,
        2 * config.nproc_per_node + 1,
    )
    script = str(SCRIPTS / "env_dump.py")
    c10d = parse_config(["--rdzv-backend", "c10d", "--rdzv_id", "myjob", script, "--nnodes", "9"], prog="t")
    assert c10d.run_id == "myjob" and c10d.script_args == ("--nnodes", "9") and c10d.nnodes == 1
    assert not c10d.notices
    spec = parse_stream_spec("0:1,1:3", "--tee")
    assert (spec.mask(0), spec.mask(1), spec.mask(5)) == (STDOUT, STDOUT | STDERR, 0)


# -- pure helpers -------------------------------------------------------------------------------


def test_line_splitter_at_every_offset() -> None:
    data = b"alpha\nbeta\n\ngam" + b"ma\ndelta"
    for cut in range(len(data) + 1):
        splitter = LineSplitter()
        lines = splitter.feed(data[:cut]) + splitter.feed(data[cut:]) + splitter.flush()
        assert lines == [b"alpha\n", b"beta\n", b"\n", b"gamma\n", b"delta\n"]


def test_line_splitter_caps_long_lines_and_tail_keeps_the_end() -> None:
    splitter = LineSplitter(max_line=4)
    assert splitter.feed(b"abcdefghij") == [b"abcd\n", b"efgh\n"]
    assert splitter.flush() == [b"ij\n"]
    tail = Tail(max_bytes=32)
    tail.feed(b"".join(b"line %d\n" % i for i in range(100)))
    assert tail.lines(2) == ["line 98", "line 99"]


def test_secret_policy_and_exit_descriptions() -> None:
    assert resolve_secret({"AIODIST_SECRET": "mine"}, 4) == ("mine", None)
    generated, warning = resolve_secret({}, 1)
    assert generated is not None and len(generated) == 64 and warning is None
    assert resolve_secret({}, 2)[0] is None
    assert describe_exit(-9) == "killed by SIGKILL (exit code -9)"
    assert describe_exit(1) == "exit code 1"
