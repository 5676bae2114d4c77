"""The torch backend "aiodist" seen from a user's script: what it prints, how a rank's end reads.

Real interpreters running torch scripts (``support.scripts.run_ranks``), as a user's would:
their stderr is read whole, torch's C++ logging included.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.scripts import run_ranks

pytest.importorskip("torch")

HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None or shutil.which("g++") is not None
needs_compiler = pytest.mark.skipif(
    not HAS_COMPILER, reason="no C++ compiler here: the aiodist torch backend's extension cannot be built"
)
ENV = {"OMP_NUM_THREADS": "1"}

SUM_SCRIPT = textwrap.dedent(
    """
    import datetime, os, sys
    import torch
    import torch.distributed as dist
    import aiodist.torch

    dist.init_process_group("aiodist", timeout=datetime.timedelta(seconds=120))
    x = torch.ones(4)
    dist.all_reduce(x)
    dist.destroy_process_group()
    print("RESULT", x.tolist(), flush=True)
    """
)


@pytest.mark.timeout(900)  # compiles the extension into a fresh cache (30 s to 2 minutes)
@needs_compiler
def test_first_group_says_it_compiles_and_ranks_share_one_build(tmp_path: Path) -> None:
    """On a fresh cache, the ranks of a job reach the first build together: one compiles and
    says so, the other says it waits for it; both then run. ``python -m aiodist.torch --build``
    afterwards finds the library built and compiles nothing."""
    script = tmp_path / "job.py"
    script.write_text(SUM_SCRIPT)
    cache = tmp_path / "cache"
    env = {**ENV, "AIODIST_CACHE_DIR": str(cache), "AIODIST_TORCH_BACKEND": "cpp"}
    ran = run_ranks(script, 2, env=env, timeout=800)
    for r in ran:
        assert r.returncode == 0, r.stderr
        assert r.results() == ["RESULT [2.0, 2.0, 2.0, 2.0]"], r.stdout
    said = [[ln for ln in r.stderr.splitlines() if ln.startswith("aiodist: ")] for r in ran]
    compiled = [r for r, lines in enumerate(said) if any(ln.startswith("aiodist: compiling") for ln in lines)]
    assert len(compiled) == 1, said
    other = said[1 - compiled[0]]
    assert any("waiting for another process to finish compiling" in ln for ln in other), said
    line = next(ln for ln in said[compiled[0]] if ln.startswith("aiodist: compiling"))
    assert "python -m aiodist.torch --build" in line and "minutes" in line, line

    built = list((cache / "torch-backend").glob("*/aiodist_torch_backend.so"))
    assert len(built) == 1, list(cache.rglob("*"))
    assert not list(built[0].parent.glob(".aiodist_torch_backend.so.*")), "a temporary copy was left"

    again = subprocess.run(
        [sys.executable, "-m", "aiodist.torch", "--build"],
        env={**os.environ, "AIODIST_CACHE_DIR": str(cache)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0, again.stderr
    assert "compiling" not in again.stderr, again.stderr
    assert f"ready in {built[0].parent}" in again.stdout, again.stdout


END_SCRIPT = textwrap.dedent(
    """
    import datetime, os, sys
    import torch
    import torch.distributed as dist
    import aiodist.torch

    how = sys.argv[1]
    dist.init_process_group("aiodist", timeout=datetime.timedelta(seconds=60))
    x = torch.ones(4)
    dist.all_reduce(x)                        # everybody is connected
    if dist.get_rank() == 1:
        if how == "raise":
            raise ValueError("boom")
        sys.exit(0)                           # the script simply ends
    try:
        dist.all_reduce(x)                    # needs rank 1, which has ended
        print("RESULT no error", flush=True)
    except Exception as exc:
        print("RESULT", type(exc).__name__, exc, flush=True)
    """
)


@pytest.mark.timeout(120)
@needs_compiler
@pytest.mark.parametrize(
    ("how", "said"),
    [
        ("raise", "rank 1 exited with an uncaught exception (ValueError: boom)"),
        ("end", "rank 1 exited (its program ended without destroy_process_group)"),
    ],
)
def test_a_rank_that_ends_is_named_with_how_it_ended(tmp_path: Path, how: str, said: str) -> None:
    """A rank whose script raises (or ends without destroy_process_group) is not reported as
    having left the job: its peers read how it ended, as on aiodist's own faces."""
    script = tmp_path / "job.py"
    script.write_text(END_SCRIPT)
    ran = run_ranks(script, 2, args=[how], env=ENV, timeout=100)
    assert ran[0].returncode == 0, ran[0].stderr
    (line,) = ran[0].results()
    assert line.startswith("RESULT DistNetworkError") and said in line, line
    assert "has left the job" not in line, line
    if how == "raise":
        assert "ValueError: boom" in ran[1].stderr and ran[1].returncode != 0


SLOW_SCRIPT = textwrap.dedent(
    """
    import asyncio, datetime, os
    import torch
    import torch.distributed as dist
    import aiodist.torch
    from aiodist.torch import _backend

    if os.environ["RANK"] == "0":
        # Rank 0 reaches aiodist's rendezvous 1.5 s after rank 1 (as a rank loading the
        # extension on a busy machine does): rank 1 waits in torch's TCPStore meanwhile.
        connect = _backend._connect

        async def late(*args):
            await asyncio.sleep(1.5)
            return await connect(*args)

        _backend._connect = late
    dist.init_process_group("aiodist", timeout=datetime.timedelta(seconds=60))
    x = torch.ones(4)
    dist.all_reduce(x)
    dist.destroy_process_group()
    print("RESULT", x.tolist(), flush=True)
    """
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("level", ["cpp", "python"])
def test_a_successful_run_logs_no_store_timeouts(tmp_path: Path, level: str) -> None:
    """No "[c10d] waitForInput ... timed out" warnings from torch's store client on a run
    where nothing went wrong, even when a rank waits for a slower one to connect."""
    if level == "cpp" and not HAS_COMPILER:
        pytest.skip("no C++ compiler here: the extension cannot be built")
    script = tmp_path / "job.py"
    script.write_text(SLOW_SCRIPT)
    ran = run_ranks(script, 2, env={**ENV, "AIODIST_TORCH_BACKEND": level}, timeout=100)
    for r in ran:
        assert r.returncode == 0, r.stderr
        assert r.results() == ["RESULT [2.0, 2.0, 2.0, 2.0]"], r.stdout
        assert "waitForInput" not in r.stderr and "timed out" not in r.stderr, r.stderr


LATE_CALLBACK_SCRIPT = textwrap.dedent(
    """
    import datetime, time
    import torch
    import torch.distributed as dist
    import aiodist.torch

    dist.init_process_group("aiodist", timeout=datetime.timedelta(seconds=60))
    x = torch.ones(1000)
    work = dist.all_reduce(x, async_op=True)

    def slow(fut):
        time.sleep(0.3)  # still running when the script ends
        print("CALLBACK", fut.value()[0][0].item(), flush=True)

    work.get_future().then(slow)
    work.wait()
    dist.destroy_process_group()
    print("RESULT ended", flush=True)
    """
)


@needs_compiler
def test_a_future_callback_still_running_at_exit_ends_before_python(tmp_path: Path) -> None:
    """A script may end while a callback of a work's future still runs on the extension's
    thread (or has yet to): the process exits cleanly once it has run, where it used to crash
    in Python's finalization (a segmentation fault, or "terminate called without an active
    exception") after the script had done all its work."""
    script = tmp_path / "late.py"
    script.write_text(LATE_CALLBACK_SCRIPT)
    ran = run_ranks(script, 2, env={**ENV, "AIODIST_TORCH_BACKEND": "cpp"}, timeout=100)
    for r in ran:
        assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
        assert r.results() == ["RESULT ended"], r.stdout
        assert "CALLBACK 2.0" in r.stdout, r.stdout
