"""The torchrun flags the launcher honours or refuses, ``--version``, and a program that does not exist.

Each case runs the real launcher (``python -m aiodist.run``) on ``env_dump.py``, whose workers
write their environment to ``$OUT_DIR/rank_<RANK>.json``; a refused command line must exit 2
before any worker starts (no such file is written).
"""

from __future__ import annotations

import importlib.metadata
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.launcher import RUN_TIMEOUT, SCRIPTS, launch, launcher_env, records, start_launcher, wait_for

from aiodist._launcher.config import REFUSED_FLAGS, build_parser, parse_config
from aiodist.testing import free_port

pytestmark = pytest.mark.timeout(60)

DUMP = str(SCRIPTS / "env_dump.py")


def _refused(tmp_path: Path, args: list[str], message: str, **env: str) -> None:
    proc = launch(args, tmp_path, **env)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr, proc.stderr
    assert not records(tmp_path), "a worker started"


# -- torchrun's rendezvous flags -----------------------------------------------------------------


def test_rdzv_endpoint_is_the_master_address_and_port(tmp_path: Path) -> None:
    args = ["--nnodes=2", "--node-rank=1", "--nproc-per-node=2", "--rdzv-backend=c10d"]
    proc = launch(
        [*args, "--rdzv-endpoint=10.1.2.3:29555", "--rdzv-id=job9", DUMP], tmp_path, AIODIST_SECRET="k"
    )
    assert proc.returncode == 0, proc.stderr
    dumped = records(tmp_path)
    assert sorted(dumped) == [2, 3]
    for record in dumped.values():
        assert (record["env"]["MASTER_ADDR"], record["env"]["MASTER_PORT"]) == ("10.1.2.3", "29555")


def test_torchrun_two_node_recipe_rendezvous(tmp_path: Path) -> None:
    """torchrun's multi-node recipe (c10d, an endpoint, one launcher per node) forms one job."""
    endpoint = f"127.0.0.1:{free_port()}"
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
    script = str(SCRIPTS / "rendezvous.py")
    node1 = start_launcher([*common, "--node-rank", "1", script], tmp_path, AIODIST_SECRET="two-nodes")
    try:
        node0 = launch(
            [*common, "--node-rank", "0", script], tmp_path, timeout=45, AIODIST_SECRET="two-nodes"
        )
        out1, err1 = node1.communicate(timeout=45)
    finally:
        node1.kill()
    assert (node0.returncode, node1.returncode) == (0, 0), node0.stderr + err1
    assert "[rank 0]: joined as 0 of 2" in node0.stdout.splitlines()
    assert "[rank 1]: joined as 1 of 2" in out1.splitlines()


@pytest.mark.parametrize(
    ("endpoint", "addr", "port"),
    [("node0.cluster", "node0.cluster", 29400), ("[fd00::1]:29600", "fd00::1", 29600), ("h:0", "h", None)],
)
def test_rdzv_endpoint_forms(endpoint: str, addr: str, port: int | None) -> None:
    config = parse_config(["--rdzv_endpoint", endpoint, "--rdzv_backend", "static", DUMP], prog="t")
    assert (config.master_addr, config.master_port) == (addr, port)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "h:2379"],
            "--rdzv-backend etcd-v2 is not supported",
        ),
        (["--nnodes", "2", "--rdzv-endpoint", "h:29400"], "needs --node-rank on each node"),
        (["--rdzv-endpoint", "h:29400", "--master-port", "29500"], "disagree"),
        (["--rdzv-endpoint", "h:port"], "is not a number"),
        (["--rdzv-conf", "join_timeout=600"], "--rdzv-conf is not supported"),
    ],
)
def test_rdzv_flags_refused(tmp_path: Path, args: list[str], message: str) -> None:
    _refused(tmp_path, [*args, DUMP], message)


# -- every other torchrun flag ------------------------------------------------------------------


@pytest.mark.parametrize("dest", sorted(REFUSED_FLAGS))
def test_unsupported_torchrun_flags_are_refused(tmp_path: Path, dest: str) -> None:
    flag = "--" + dest.replace("_", "-")
    _refused(tmp_path, [flag, "x", DUMP], f"{flag} is not supported")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--event-log-handler", "console"], "--event-log-handler console is not supported"),
        (["--nproc-per-node", "xpu"], "XPU devices are not supported"),
        (["--monitor-interval", "0"], "--monitor-interval must be > 0"),
        (["--signals-to-handle", "SIGTERM,SIGNOPE"], "'SIGNOPE' is not a signal"),
        (["--signals-to-handle", "SIGKILL"], "SIGKILL cannot be handled"),
        (["--start-method", "thread"], "invalid choice: 'thread'"),
    ],
)
def test_bad_torchrun_values_are_refused(tmp_path: Path, args: list[str], message: str) -> None:
    _refused(tmp_path, [*args, DUMP], message)


def test_accepted_torchrun_flags(tmp_path: Path) -> None:
    args = [
        "--nproc_per_node=2",
        "--start-method=fork",
        "--event-log-handler=null",
        "--run-path",
        "--no-python",
    ]
    args += ["--local-addr=127.0.0.1", "--virtual-local-rank", "--shutdown-timeout=7", DUMP]
    proc = launch(args, tmp_path, CUDA_VISIBLE_DEVICES="3,5")
    assert proc.returncode == 0, proc.stderr
    dumped = records(tmp_path)
    assert sorted(dumped) == [0, 1]  # --run-path won over --no-python: the script ran under Python
    for rank, record in dumped.items():
        env = record["env"]
        assert env["AIODIST_HOST"] == "127.0.0.1"
        assert (env["LOCAL_RANK"], env["CUDA_VISIBLE_DEVICES"], env["RANK"]) == ("0", "35"[rank], str(rank))
    assert parse_config(["--shutdown_timeout", "7", DUMP], prog="t").term_timeout == 7


def test_torch_shutdown_timeout_variable_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIODIST_TERM_TIMEOUT", raising=False)
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "12")
    assert parse_config([DUMP], prog="t").term_timeout == 12
    monkeypatch.setenv("AIODIST_TERM_TIMEOUT", "3")
    assert parse_config([DUMP], prog="t").term_timeout == 3


def test_flags_from_pet_variables(tmp_path: Path) -> None:
    """torchrun reads an unset flag from PET_<NAME>: PET_NPROC_PER_NODE=2 starts two workers."""
    proc = launch([DUMP], tmp_path, PET_NPROC_PER_NODE="2", PET_MASTER_PORT="29577", PET_STANDALONE="0")
    assert proc.returncode == 0, proc.stderr
    dumped = records(tmp_path)
    assert sorted(dumped) == [0, 1] and dumped[0]["env"]["MASTER_PORT"] == "29577"


def test_monitor_interval_is_the_supervisors_poll_interval(tmp_path: Path) -> None:
    """Rank 0 exits 3 after 1.5 s; the launcher looks at the workers only every 3 s."""
    script = ["--no-python", "sh", "-c", 'if [ "$RANK" = 0 ]; then sleep 1.5; exit 3; fi; sleep 30']
    started = time.monotonic()
    proc = launch(["--nproc-per-node", "2", "--monitor-interval", "3", *script], tmp_path)
    took = time.monotonic() - started
    assert proc.returncode == 1, proc.stderr
    assert "exit code 3" in proc.stderr
    assert took >= 3, took  # the exit is seen at the second look, 3 s after the first


def test_signals_to_handle_forwards_the_named_signal(tmp_path: Path) -> None:
    args = ["--nproc-per-node", "2", "--signals-to-handle", "SIGUSR1,TERM", str(SCRIPTS / "wait_signal.py")]
    launcher = start_launcher(args, tmp_path)
    try:
        wait_for([tmp_path / "ready_0", tmp_path / "ready_1"], launcher)
        launcher.send_signal(signal.SIGUSR1)
        _, stderr = launcher.communicate(timeout=RUN_TIMEOUT)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signal.SIGUSR1, stderr
    assert "received SIGUSR1" in stderr


# -- --version and a program that is not there ---------------------------------------------------


@pytest.mark.parametrize("module", ["aiodist.run", "aiodist.launch"])
def test_version(tmp_path: Path, module: str) -> None:
    proc = launch(["--version"], tmp_path, module=module)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"aiodist {importlib.metadata.version('aiodist')}"


def test_console_script_version(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("aiodist-run")
    if not script.exists():
        pytest.skip("the aiodist-run console script is not installed next to this interpreter")
    proc = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert (proc.returncode, proc.stdout.strip()) == (0, f"aiodist {importlib.metadata.version('aiodist')}")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["no_such_train.py"], "no_such_train.py: no such file"),
        (["-m", "no_such_module_xyz"], "-m no_such_module_xyz: no module named 'no_such_module_xyz'"),
        (
            ["-m", "tests.support.launcher_scripts.no_such"],
            "no module named 'tests.support.launcher_scripts.no_such'",
        ),
        (["--no-python", "no-such-program-xyz"], "no-such-program-xyz: no such executable"),
    ],
)
def test_missing_program_is_refused_before_any_worker_starts(
    tmp_path: Path, args: list[str], message: str
) -> None:
    started = time.monotonic()
    _refused(tmp_path, ["--nproc-per-node", "2", *args], message)
    assert time.monotonic() - started < RUN_TIMEOUT


def test_module_in_the_current_directory_is_found(tmp_path: Path) -> None:
    """``python -m`` looks in the current directory first; so does the check, whatever the launcher's path."""
    (tmp_path / "local_job.py").write_text("import os\nprint('local job', os.environ['RANK'])\n")
    proc = subprocess.run(
        # -P: like the aiodist-run console script, the launcher's own sys.path lacks the directory.
        [sys.executable, "-P", "-m", "aiodist.run", "-m", "local_job"],
        cwd=tmp_path,
        env=launcher_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "[rank 0]: local job 0" in proc.stdout


def test_every_torchrun_flag_is_known() -> None:
    """Each of torchrun's option strings is one of ours: honoured, or refused with a reason."""
    torchrun = pytest.importorskip("torch.distributed.run")
    ours = {flag for action in build_parser("t")._actions for flag in action.option_strings}
    theirs = {flag for action in torchrun.get_args_parser()._actions for flag in action.option_strings}
    assert theirs - ours == set()


def test_nproc_auto_and_gpu_count_cuda_devices(tmp_path: Path) -> None:
    """As torchrun: "auto" is one worker per CUDA device, else per CPU; "gpu" needs a device."""
    torch = pytest.importorskip("torch")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert parse_config(["--nproc-per-node", "auto", DUMP], prog="t").nproc_per_node == (
        gpus or os.cpu_count()
    )
    if gpus:
        assert parse_config(["--nproc-per-node", "gpu", DUMP], prog="t").nproc_per_node == gpus
    else:
        _refused(
            tmp_path, ["--nproc-per-node", "gpu", DUMP], "--nproc-per-node gpu: no CUDA device is visible"
        )
