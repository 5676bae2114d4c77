"""A script converted by its import line (``import aiodist.sync as dist``) under torchrun.

torchrun's agent hosts torch's own store at MASTER_ADDR:MASTER_PORT and keeps it across
restarts; aiodist's env:// rendezvous joins it as a client, one namespace per restart attempt.
The same script runs under aiodist-run. Each case runs real launchers and workers on 127.0.0.1
with ephemeral ports, bounded by the timeouts below.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from support.launcher import REPO, SCRIPTS, launch, launcher_env

import aiodist
from aiodist.testing import free_port

torch = pytest.importorskip("torch")
from torch.utils.data import DistributedSampler  # noqa: E402

pytestmark = pytest.mark.timeout(150)

CONVERTED = str(SCRIPTS / "converted.py")
TORCHRUN_TIMEOUT = 120.0


def torchrun_cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def torchrun(args: list[str], out_dir: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    """Runs torchrun (``python -m torch.distributed.run``, the venv's ``torchrun``) to completion."""
    return subprocess.run(
        torchrun_cmd(args),
        cwd=REPO,
        env=launcher_env(out_dir, **extra),
        capture_output=True,
        text=True,
        timeout=TORCHRUN_TIMEOUT,
    )


def results(out_dir: Path) -> dict[tuple[int, int], dict[str, Any]]:
    """(attempt, rank) -> what converted.py's rank wrote in that attempt."""
    found = {}
    for path in out_dir.glob("attempt_*_rank_*.json"):
        _, attempt, _, rank = path.stem.split("_")
        found[int(attempt), int(rank)] = json.loads(path.read_text())
    return found


def check_attempt(found: dict[tuple[int, int], dict[str, Any]], attempt: int, size: int) -> None:
    """Every rank of ``attempt`` computed the right values, and heard rank 0 of that attempt."""
    records = [found[attempt, r] for r in range(size)]
    expected = [float(size * i + size * (size - 1) // 2) for i in range(4)]
    words = {rec["word"] for rec in records}
    assert words == {f"attempt {attempt}, pid {found[attempt, 0]['pid']}"}, records
    for rank, rec in enumerate(records):
        assert rec["size"] == size
        assert rec["total"] == expected
        assert rec["thirds"] == [str(Fraction(r + 1, 3)) for r in range(size)]
        # DistributedSampler asked torch.distributed for this rank's place in the job.
        told = DistributedSampler(range(10), num_replicas=size, rank=rank, seed=attempt)
        assert rec["sampler"] == list(told)
        assert rec["through torch"] == [float(size * (size + 1) // 2)] * 2


def test_standalone(tmp_path: Path) -> None:
    proc = torchrun(["--standalone", "--nproc-per-node", "2", CONVERTED], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert set(results(tmp_path)) == {(0, 0), (0, 1)}
    check_attempt(results(tmp_path), 0, 2)


def test_the_async_face(tmp_path: Path) -> None:
    proc = torchrun(
        ["--standalone", "--nproc-per-node", "2", str(REPO / "examples" / "hello_async.py")], tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        assert f"rank {rank} of 2: all_reduce -> [3. 3. 3.], broadcast from rank 0 -> [7 7]" in proc.stdout


def test_static_rendezvous_on_a_given_port(tmp_path: Path) -> None:
    # Without --standalone, a single node's torchrun hosts its store at --master-port.
    proc = torchrun(["--nproc-per-node", "2", "--master-port", str(free_port()), CONVERTED], tmp_path)
    assert proc.returncode == 0, proc.stderr
    check_attempt(results(tmp_path), 0, 2)


def test_when_torchrun_shares_no_store_rank_0_hosts_one(tmp_path: Path) -> None:
    """TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: torchrun hosts no store for its workers (as aiodist-run)."""
    args = ["--standalone", "--nproc-per-node", "2", CONVERTED]
    proc = torchrun(args, tmp_path, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", AIODIST_SECRET="s3cret")
    assert proc.returncode == 0, proc.stderr
    check_attempt(results(tmp_path), 0, 2)


@pytest.mark.parametrize("how", ["sync face", "torch backend"])
def test_a_restarted_worker_group_meets_in_a_fresh_namespace(how: str, tmp_path: Path) -> None:
    """Rank 1 fails in attempt 0; the restarted group never reads attempt 0's keys.

    Also for unconverted torch code on the "aiodist" backend (its Python-only level: no build).
    """
    args = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", CONVERTED]
    extra = (
        {"TORCH_BACKEND_AIODIST": "1", "AIODIST_TORCH_BACKEND": "python"} if how == "torch backend" else {}
    )
    proc = torchrun(args, tmp_path, FAIL_ONCE_RANK="1", **extra)
    assert proc.returncode == 0, proc.stderr
    found = results(tmp_path)
    assert set(found) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    check_attempt(found, 0, 2)
    check_attempt(found, 1, 2)
    assert {found[1, r]["pid"] for r in (0, 1)}.isdisjoint({found[0, r]["pid"] for r in (0, 1)})


def _two_agents(args: list[str], env: dict[str, str]) -> list[tuple[str, str]]:
    """Two torchrun agents (two nodes of one job) run to completion; both must succeed."""
    agents = [
        subprocess.Popen(
            torchrun_cmd(args), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    try:
        outputs = [agent.communicate(timeout=TORCHRUN_TIMEOUT) for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    return outputs


def test_two_agents_on_one_machine(tmp_path: Path) -> None:
    """--nnodes 2: two torchrun agents meet through the c10d rendezvous, one worker each."""
    port = free_port()
    args = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    args += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-agents", CONVERTED]
    _two_agents(args, launcher_env(tmp_path))
    found = results(tmp_path)
    check_attempt(found, 0, 2)
    assert {found[0, r]["node"] for r in (0, 1)} == {"0", "1"}


def test_nodes_an_attempt_apart_come_back_in_step(tmp_path: Path) -> None:
    """A node whose healthy workers are restarted for another node's failure counts no restart.

    Rank 1 fails in attempt 0 while rank 0 idles: rank 1's agent counts a restart (attempt 1),
    rank 0's agent restarts its worker uncounted (attempt 0 again). That worker finds attempt 1
    recorded and fails at once, saying why; its agent counts a restart, and both nodes' workers
    meet in attempt 1.
    """
    port = free_port()
    args = ["--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "2", "--rdzv-backend", "c10d"]
    args += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "apart", CONVERTED]
    env = launcher_env(tmp_path, FAIL_ONCE_RANK="1", IDLE_ONCE_SECONDS="60")
    outputs = _two_agents(args, env)
    stderr = "".join(err for _, err in outputs)
    assert "and another node's workers already reached attempt 1" in stderr or (
        "under torchrun that is a worker of an earlier worker group" in stderr
    ), stderr
    check_attempt(results(tmp_path), 1, 2)


def test_the_same_script_under_aiodist_run(tmp_path: Path) -> None:
    proc = launch(["--standalone", "--nproc-per-node", "2", CONVERTED], tmp_path, timeout=TORCHRUN_TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    check_attempt(results(tmp_path), 0, 2)


async def test_without_torch_the_error_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    for name, value in [
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", str(port)),
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
    ]:
        monkeypatch.setenv(name, value)
    monkeypatch.setitem(sys.modules, "torch.distributed", None)  # import torch.distributed fails
    with pytest.raises(aiodist.DistStoreError) as caught:
        await aiodist.init_process_group("tcp", timeout=5)
    msg = str(caught.value)
    assert f"rank 0 cannot join the store at 127.0.0.1:{port}" in msg
    assert "torchrun hosts torch's own store there (TORCHELASTIC_USE_AGENT_STORE=True)" in msg
    assert "pip install 'aiodist[torch]'" in msg and "aiodist-run" in msg
    assert not aiodist.is_initialized()


async def test_a_long_wait_on_torchs_store_lets_other_calls_through() -> None:
    """torch's store serves one call at a time per connection: aiodist waits by polling its
    non-blocking check, so a long wait never holds the connection."""
    import datetime

    import torch.distributed as td

    from aiodist.store.c10d import TorchStore

    server = td.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    client = td.TCPStore(
        "127.0.0.1", server.port, None, False, datetime.timedelta(seconds=30), wait_for_workers=False
    )
    store = TorchStore(client, 30.0)
    waiting = asyncio.ensure_future(store.wait(["late"], timeout=30.0))
    await asyncio.sleep(1.5)  # the wait is under way
    await store.set("other", "v")  # these would queue behind one 30 s wait
    assert await store.get("other") == b"v"
    assert not waiting.done()
    await store.set("late", "here")
    await asyncio.wait_for(waiting, 10)
    with pytest.raises(aiodist.DistTimeoutError):
        await store.wait(["never"], timeout=1.1)
