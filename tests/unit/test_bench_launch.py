"""``aiodist-bench`` as one rank of a launched job: which launcher started it (from its
environment), where its ranks ran (placement), where rank 0 can be reached, and the options a
launched job refuses. Pure functions: no process, no socket."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from aiodist._launcher.config import parse_config
from aiodist.bench import cli as bench
from aiodist.bench.hosts import choose_master_address, describe_hosts, placement
from aiodist.bench.launched import measured_options, options_differ, refusal
from aiodist.bench.launchers import Launch, LaunchError, detect_launch, tasks_on_node
from aiodist.bench.worker import JobConfig


def test_aiodist_run_and_torchrun_are_told_apart() -> None:
    common = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    ours = detect_launch({**common, "TORCHELASTIC_RUN_ID": "r", "AIODIST_RESTART_COUNT": "0"})
    assert ours == Launch("aiodist-run", "env", "RANK/WORLD_SIZE", 3, 4, 1, 2, agent_store=False)
    torchrun = detect_launch({**common, "TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert torchrun is not None and torchrun.launcher == "torchrun" and torchrun.agent_store
    # aiodist-run passes its environment on: a stray variable does not make it torchrun's store.
    stray = detect_launch({**common, "AIODIST_RESTART_COUNT": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert stray is not None and not stray.agent_store
    plain = detect_launch(common)
    assert plain is not None and plain.launcher == "a launcher (RANK/WORLD_SIZE)" and not plain.is_mpi


def test_mpi_pmi_and_slurm_variables() -> None:
    ompi = detect_launch(
        {
            "OMPI_COMM_WORLD_RANK": "2",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        }
    )
    assert ompi == Launch(
        "mpirun (Open MPI)", "ompi", "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE", 2, 4, 0, 2
    )
    assert ompi.is_mpi
    pmi = detect_launch({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert pmi is not None and (pmi.launcher, pmi.local_world_size, pmi.is_mpi) == ("mpiexec (PMI)", 2, True)
    slurm = detect_launch(
        {
            "SLURM_PROCID": "4",
            "SLURM_NTASKS": "5",
            "SLURM_LOCALID": "0",
            "SLURM_NODEID": "2",
            "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
        }
    )
    assert slurm is not None and (slurm.launcher, slurm.rank, slurm.local_world_size) == (
        "srun (Slurm)",
        4,
        1,
    )
    assert not slurm.is_mpi
    # RANK/WORLD_SIZE come first, as aiodist's env:// rendezvous reads them.
    both = detect_launch(
        {"RANK": "0", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}
    )
    assert both is not None and both.kind == "env"


def test_no_launcher_and_nonsense_variables() -> None:
    assert detect_launch({}) is None
    assert detect_launch({"RANK": "0"}) is None  # a rank without a world size is no launch
    with pytest.raises(LaunchError, match=r"RANK='x' is not an integer"):
        detect_launch({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(LaunchError, match=r"PMI_RANK=2 with PMI_SIZE=2"):
        detect_launch({"PMI_RANK": "2", "PMI_SIZE": "2"})


def test_slurm_tasks_per_node() -> None:
    assert [tasks_on_node("2(x3),1", i) for i in range(5)] == [2, 2, 2, 1, None]
    assert tasks_on_node("4", 0) == 4
    assert tasks_on_node("garbage", 0) is None


def _record(rank: int, host: str, address: str, network: str = "net") -> dict[str, object]:
    return {
        "rank": rank,
        "hostname": "node",
        "host": host,
        "address": address,
        "network": network,
        "gloo_ifname": "eth0",
    }


def test_placement_counts_hosts_and_ranks() -> None:
    even = placement([_record(r, f"h{r // 2}", f"10.0.0.{r // 2 + 1}", f"n{r // 2}") for r in range(4)])
    assert even["text"] == "2 hosts x 2 ranks" and not even["notes"]
    assert [(h["host"], h["ranks"], h["addresses"]) for h in even["hosts"]] == [
        ("h0", [0, 1], ["10.0.0.1"]),
        ("h1", [2, 3], ["10.0.0.2"]),
    ]
    # Two hosts of one name are told apart by their ids.
    assert describe_hosts(even) == (
        "2 hosts x 2 ranks: node [h0] (10.0.0.1, gloo on eth0): ranks 0,1; node [h1] (10.0.0.2, gloo on eth0): ranks 2,3"
    )
    uneven = placement(
        [
            _record(0, "a", "x", "n0"),
            _record(1, "a", "x", "n0"),
            _record(2, "a", "x", "n0"),
            _record(3, "b", "y", "n1"),
        ]
    )
    assert uneven["text"] == "2 hosts (3+1 ranks)"
    assert [h["ranks_text"] for h in uneven["hosts"]] == ["0-2", "3"]
    assert placement([_record(0, "a", "x")])["text"] == "1 host x 1 rank"


def test_network_namespaces_of_one_host_id_are_pointed_out() -> None:
    place = placement([_record(0, "vm", "10.0.0.1", "ns-a"), _record(1, "vm", "10.0.0.2", "ns-b")])
    assert place["text"] == "1 host x 2 ranks"
    (note,) = place["notes"]
    assert "2 network namespaces" in note and "AIODIST_HOST_ID" in note and "--aiodist-transports tcp" in note


def test_rank_0s_address_is_one_every_host_reaches() -> None:
    lo = ("lo", "127.0.0.1/8")
    assert choose_master_address([lo, ("eth0", "10.0.0.1/24")], ["k", "k"], [[lo]]) == "127.0.0.1"
    mine = [lo, ("mgmt", "192.168.1.5/24"), ("veth0", "10.77.0.1/24")]
    others = [[lo, ("veth1", "10.77.0.2/24")], [lo, ("veth2", "10.77.0.3/24"), ("mgmt", "192.168.1.6/24")]]
    assert choose_master_address(mine, ["a", "b", "c"], others) == "10.77.0.1"
    with pytest.raises(ValueError, match="set MASTER_ADDR"):
        choose_master_address(mine, ["a", "b"], [[lo, ("x", "172.16.0.2/16")]])


def _args(argv: list[str]) -> argparse.Namespace:
    return bench._parser().parse_args(argv)


LAUNCH = Launch("aiodist-run", "env", "RANK/WORLD_SIZE", 0, 4)


@pytest.mark.parametrize(
    ("argv", "world_sizes", "message"),
    [
        ([], [2], "-np 2: aiodist-run started 4 ranks (RANK/WORLD_SIZE)"),
        ([], [2, 4], "-np 2,4: aiodist-run started 4 ranks"),
        (["--faces", "async,sync"], None, "a launched job measures one face per launch"),
        (["--aiodist-transports", "tcp,shm"], None, "one transport per launch"),
        (["--mpiexec", "/usr/bin/mpiexec"], None, "--mpiexec: the bench starts its own mpiexec only when"),
        (["--mpi-start-timeout", "5"], None, "--mpi-start-timeout: the bench starts its own mpiexec"),
    ],
)
def test_launched_jobs_refuse_what_contradicts_the_launch(
    argv: list[str], world_sizes: list[int] | None, message: str
) -> None:
    why = refusal(_args(argv), LAUNCH, world_sizes)
    assert why is not None and message in why


def test_launched_jobs_accept_what_agrees_with_the_launch() -> None:
    assert refusal(_args(["--faces", "sync", "--aiodist-transports", "tcp"]), LAUNCH, [4]) is None
    assert refusal(_args([]), LAUNCH, None) is None


def test_every_rank_must_measure_what_rank_0_measures() -> None:
    cfg = JobConfig(face="async", nprocs=2, ops=("all_reduce",), sizes=(4, 4096), compare=True)
    same = measured_options(cfg)
    assert same["sizes"] == [4, 4096] and "timeout" not in same  # as the options travel
    waits_longer = measured_options(JobConfig(**{**cfg.__dict__, "timeout": 5.0}))
    assert options_differ([same, waits_longer]) is None
    other = measured_options(JobConfig(**{**cfg.__dict__, "sizes": (4,), "compare": False}))
    why = options_differ([same, same, other])
    assert why is not None
    assert why.startswith(
        "rank 2 was given other options than rank 0: sizes [4] (rank 0: [4, 4096]); compare False"
    )


# -- how the bench is launched: aiodist-run's command line, the sync face's init -----------------

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # where the aiodist-bench console script is installed


@pytest.fixture
def bench_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    if not (BIN / "aiodist-bench").exists():
        pytest.skip("the aiodist-bench console script is not installed next to this interpreter")
    monkeypatch.setenv("PATH", os.pathsep.join([str(BIN), os.environ.get("PATH", "")]))


def _worker_argv(argv: list[str]) -> list[str]:
    return parse_config(argv, prog="aiodist.run").command(1)


@pytest.mark.usefixtures("bench_on_path")
def test_the_installed_command_runs_with_no_python_and_the_module_with_m(
    capsys: pytest.CaptureFixture[str],
) -> None:
    launcher = ["--standalone", "--nproc-per-node", "2"]
    bench_args = ["--faces", "sync", "--compare", "gloo"]
    # The console script, exec'd from PATH as it is (torchrun's --no-python, either spelling).
    installed = _worker_argv([*launcher, "--no-python", "aiodist-bench", *bench_args])
    assert installed == ["aiodist-bench", *bench_args]
    assert _worker_argv([*launcher, "--no_python", "aiodist-bench"]) == ["aiodist-bench"]
    # The module, under the launcher's own interpreter (unbuffered, for the relay).
    module = [sys.executable, "-u", "-m", "aiodist.bench", *bench_args]
    assert _worker_argv([*launcher, "-m", "aiodist.bench", *bench_args]) == module
    assert _worker_argv([*launcher, "--module", "aiodist.bench", *bench_args]) == module
    # Without either, the name is a Python file, as under torchrun: refused, with the way out.
    with pytest.raises(SystemExit) as exc:
        parse_config([*launcher, "aiodist-bench", *bench_args], prog="aiodist.run")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "aiodist-bench: no such file (the script each worker would run)" in err
    assert "aiodist-bench is a command on PATH: run it with --no-python aiodist-bench" in err


def _documented_bench_launches() -> list[tuple[str, list[str]]]:
    """Every ``aiodist-run ... aiodist-bench``/``aiodist.bench`` command the docs show, as argv."""
    found: list[tuple[str, list[str]]] = []
    for name in ("docs/guide.md", "BENCHMARKS.md", "aiodist/bench/cli.py"):
        # Join continued lines (cli.py's epilog writes its backslash doubled).
        text = re.sub(r"\\\\?\n\s*", " ", (REPO / name).read_text())
        for line in text.splitlines():
            start = line.find("aiodist-run --")  # a command, not prose naming it
            command = line[start:].split("`")[0] if start >= 0 else ""
            if "aiodist-bench" not in command and "aiodist.bench" not in command:
                continue
            argv = shlex.split(command, comments=True)[1:]
            found.append((name, ["0" if arg == "K" else arg for arg in argv]))  # K: the node rank
    return found


@pytest.mark.usefixtures("bench_on_path")
def test_the_documented_launches_of_the_bench_parse() -> None:
    launches = _documented_bench_launches()
    assert {name for name, _ in launches} == {"docs/guide.md", "BENCHMARKS.md", "aiodist/bench/cli.py"}
    for name, argv in launches:
        try:
            cfg = parse_config(argv, prog="aiodist.run")
        except SystemExit:
            pytest.fail(f"{name}: aiodist-run {shlex.join(argv)} is refused")
        runs_the_bench = (("aiodist-bench",), (sys.executable, "-u", "-m", "aiodist.bench"))
        assert cfg.program in runs_the_bench, (name, argv)
