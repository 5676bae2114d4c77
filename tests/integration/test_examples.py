"""Every example runs on torch.distributed (gloo) and on aiodist.sync and prints the same results.

Each example switches its import line on EXAMPLE_BACKEND; here both versions run at once, as
real processes on loopback with free ports, and what they print is compared record by record
(numbers to a relative 1e-6, everything else exactly). Launcher examples run under torch's own
launcher (``torch.distributed.launch`` / ``torchrun``) for torch and under aiodist's for aiodist.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from aiodist.testing import free_port

pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
RUN_TIMEOUT = 90.0
PY = sys.executable


@dataclass(frozen=True)
class Example:
    script: str
    records: int  # how many result records the run prints
    launcher: str | None = None  # "launch" (legacy, --local_rank) or "run" (torchrun-style)


CASES = {
    "p2p_blocking": Example("p2p_blocking.py", 4),
    "p2p_nonblocking": Example("p2p_nonblocking.py", 4 + 2),
    "allreduce_group": Example("allreduce_group.py", 4),
    "ring_allreduce": Example("ring_allreduce.py", 4),
    "sgd_allreduce": Example("sgd_allreduce.py", 2 * 5 + 2),
    "collectives_tour": Example("collectives_tour.py", 4 * 10 + 1 + 1),
    "init_by_hand": Example("init_by_hand.py", 4),
    "single_process_train": Example("single_process_train.py", 1 + 10 + 1),
    "launch_local_rank": Example("launch_local_rank.py", 2, launcher="launch"),
    "launch_env": Example("launch_env.py", 3, launcher="run"),
}

# One result record: from "Rank" to the end of the line or the next "Rank" (ranks share one
# pipe, so a record's newline can land after another rank's text).
_RECORD = re.compile(r"Rank\b.*?(?=Rank\b|\n|$)")
_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?", re.M)
_NUMBER = re.compile(r"-?\d+\.\d+(?:e[-+]?\d+)?")


def _command(ex: Example, backend: str, port: int) -> list[str]:
    script = str(EXAMPLES / ex.script)
    if ex.launcher is None:
        return [PY, script]
    if ex.launcher == "launch":
        module = "torch.distributed.launch" if backend == "torch" else "aiodist.launch"
        return [PY, "-m", module, "--nproc_per_node=2", f"--master_port={port}", script]
    module = "torch.distributed.run" if backend == "torch" else "aiodist.run"
    return [PY, "-m", module, "--nproc-per-node", "2", "--master-port", str(port), script]


def _start(ex: Example, backend: str) -> subprocess.Popen[str]:
    port = free_port()
    # Not PYTHONUNBUFFERED: a buffered print(..., flush=True) reaches the shared pipe in one write.
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "AIODIST_SECRET", "PYTHONUNBUFFERED")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(EXAMPLE_BACKEND=backend, MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.Popen(
        _command(ex, backend, port),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen[str], what: str) -> str:
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{what} did not finish in {RUN_TIMEOUT} s\nstdout:\n{out}\nstderr:\n{err[-3000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{what} exited {proc.returncode}\nstdout:\n{out}\nstderr:\n{err[-3000:]}")
    return out


def records(output: str) -> list[str]:
    """The result records of a run, launcher prefixes removed, sorted (ranks print in any order)."""
    text = _PREFIX.sub("", output)
    return sorted(m.group(0).strip() for m in _RECORD.finditer(text))


def same_record(a: str, b: str) -> bool:
    """Equal text, and equal numbers to a relative 1e-6."""
    if _NUMBER.sub("#", a) != _NUMBER.sub("#", b):
        return False
    return all(
        math.isclose(float(x), float(y), rel_tol=1e-6, abs_tol=1e-9)
        for x, y in zip(_NUMBER.findall(a), _NUMBER.findall(b), strict=True)
    )


def test_record_parsing() -> None:
    out = "[rank 1]: Rank 1 scatter: [1.5, 1.5]Rank 2 scatter: [2.5]\n\nRank 0, epoch 0: loss 1.0\nnoise\n"
    assert records(out) == [
        "Rank 0, epoch 0: loss 1.0",
        "Rank 1 scatter: [1.5, 1.5]",
        "Rank 2 scatter: [2.5]",
    ]
    assert same_record("loss 1.0000001", "loss 1.0000002") and not same_record("loss 1.0", "loss 1.1")


@pytest.mark.parametrize("name", list(CASES))
def test_example_matches_torch(name: str) -> None:
    ex = CASES[name]
    ours, theirs = _start(ex, "aiodist"), _start(ex, "torch")
    got_ours = records(_finish(ours, f"{name} on aiodist"))
    got_torch = records(_finish(theirs, f"{name} on torch.distributed"))
    assert len(got_torch) == ex.records, got_torch
    assert len(got_ours) == len(got_torch), (got_ours, got_torch)
    for a, b in zip(got_ours, got_torch, strict=True):
        assert same_record(a, b), f"aiodist printed {a!r}, torch printed {b!r}"
    _check_semantics(name, got_ours)


def _check_semantics(name: str, recs: list[str]) -> None:
    """What the example is about, beyond agreeing with torch."""
    text = "\n".join(recs)
    if name in ("p2p_blocking", "p2p_nonblocking"):
        assert re.search(r"Rank\s+3\s+has data\s+1\.0", text) and re.search(
            r"Rank\s+1\s+has data\s+0\.0", text
        )
    elif name == "allreduce_group":  # members sum, non-members are skipped
        assert [r.split()[-1] for r in recs] == ["2.0", "2.0", "1.0", "1.0"]
    elif name == "ring_allreduce":
        assert all(r.endswith("True") for r in recs)
    elif name == "sgd_allreduce":
        assert text.count("same on every rank: True") == 2
    elif name == "launch_env":
        assert "launched by an elastic launcher: True" in text and "local ranks [0, 1]" in text
