"""The launcher's failure summary: which rank it blames, how it lists the others, the traceback tail.

The first tests run real jobs (``aiodist.sync`` workers under ``aiodist.run``) where rank 1 goes
wrong while the others are in a collective; the rest pin the rule on hand-made exits.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.launcher import SCRIPTS, launch, summary_field, summary_of

from aiodist._launcher.summary import WorkerExit, format_summary, root_cause
from aiodist._launcher.tracebacks import blamed_rank, compress_frames, error_line

pytestmark = pytest.mark.timeout(90)

JOB = str(SCRIPTS / "collective_fault.py")


def _others(summary: str) -> dict[int, str]:
    """rank -> its line under "Other workers on this node"."""
    block = summary.split("Other workers on this node:", 1)[1]
    return {int(m.group(1)): m.group(0) for m in re.finditer(r"^  rank (\d+) \(.*$", block, re.MULTILINE)}


def _run_job(tmp_path: Path, mode: str) -> str:
    proc = launch(["--standalone", "--nproc-per-node", "3", JOB, mode], tmp_path, timeout=60)
    assert proc.returncode == 1, proc.stderr
    return summary_of(proc.stderr)


def test_rank_raising_while_others_wait_is_the_root_cause(tmp_path: Path) -> None:
    summary = _run_job(tmp_path, "raise")
    assert re.search(r"^Root cause: rank 1 \(.*the errors of ranks 0, 2 lead to it\)$", summary, re.M), (
        summary
    )
    assert summary_field(summary, "error") == "ValueError: bad batch on rank 1"
    # The user's own frame and line are in the tail.
    assert 'raise ValueError("bad batch on rank 1")' in summary
    others = _others(summary)
    assert sorted(others) == [0, 2]
    for line in others.values():
        # Every rank exited by itself with an error naming what happened elsewhere; none was stopped.
        assert "failed on its own, exit code 1" in line and "DistNetworkError" in line, summary
    assert "stopped by the launcher" not in summary


def test_shape_mismatch_blames_a_rank_of_the_disagreement_never_a_bystander(tmp_path: Path) -> None:
    """Rank 1 all_reduces 20 float32 where ranks 0 and 2 all_reduce 10.

    The two sides of a mismatch report each other; which of them the summary names depends on
    which rank detected it first, but it is never rank 2, which only abandoned the operation.
    """
    summary = _run_job(tmp_path, "mismatch")
    root = int(summary_field(summary, "rank").split()[0])
    assert root in (0, 1), summary
    assert "float32 x 20" in summary_field(summary, "error") and "float32 x 10" in summary
    assert "ranks 0 and 1 blame each other" in summary or "ranks 1 and 0 blame each other" in summary
    # The user's line survives the folding of the aiodist/asyncio frames; the internals do not.
    assert "dist.all_reduce(np.ones(count, np.float32))" in summary
    assert re.search(r"\(\d+ aiodist/asyncio frames? hidden\)", summary), summary
    assert "_bridge.py" not in summary and "_loop_thread.py" not in summary
    assert all("failed on its own" in line for line in _others(summary).values()), summary
    assert "stopped by the launcher" not in summary


# -- the rule, on hand-made exits ---------------------------------------------------------------


def _exit(
    rank: int, error: str | None, *, at: float = 100.0, code: int = 1, stopped: int | None = None
) -> WorkerExit:
    return WorkerExit(
        rank=rank,
        local_rank=rank % 4,
        pid=1000 + rank,
        returncode=code,
        exit_time=at,
        stopped_by=stopped,
        error=error,
    )


def test_root_cause_follows_the_chain_of_abandoned_operations() -> None:
    # Rank 1 raised; ranks 0 and 3 only heard of it through rank 2 (and exited first).
    exits = [
        _exit(
            0, "DistNetworkError: all_reduce on rank 0: rank 2 abandoned all_reduce #4: rank 1 exited", at=1.0
        ),
        _exit(1, "KeyError: 'label'", at=1.2),
        _exit(2, "DistNetworkError: all_reduce #4 on rank 2 failed: rank 1 closed its connection", at=1.1),
        _exit(3, "DistNetworkError: rank 2 abandoned all_reduce #4: rank 1 closed its connection", at=1.0),
    ]
    root = root_cause(exits)
    assert root is not None and root.rank == 1
    summary = format_summary(exits, prog="aiodist.run", node_rank=0, restarts=0, max_restarts=0)
    assert "Root cause: rank 1 (failed on its own; the errors of ranks 0, 2, 3 lead to it)" in summary


def test_root_cause_in_a_mismatch_goes_to_the_rank_both_bystanders_reach() -> None:
    fingerprint = "rank 0 expected all_reduce #1 (float32 x 10) but rank 1 sent all_reduce #1 (float32 x 20)"
    exits = [
        _exit(0, f"CollectiveMismatchError: {fingerprint}"),
        _exit(1, f"CollectiveMismatchError: {fingerprint}"),
        _exit(2, f"CollectiveMismatchError: rank 0 abandoned all_reduce #1: {fingerprint}"),
        _exit(3, f"CollectiveMismatchError: rank 1 abandoned all_reduce #1: {fingerprint}"),
        _exit(4, f"CollectiveMismatchError: rank 1 abandoned all_reduce #1: {fingerprint}"),
    ]
    # Ranks 0 and 1 blame each other; the bystanders' chains reach rank 1 twice, rank 0 once.
    root = root_cause(exits)
    assert root is not None and root.rank == 1


def test_stopped_and_successful_workers_are_never_the_root_cause() -> None:
    exits = [
        _exit(0, None, code=-15, stopped=15, at=5.0),
        _exit(1, "DistTimeoutError: all_reduce #9 on rank 1 timed out waiting for data from rank 0", at=4.0),
        _exit(2, None, code=0, at=1.0),
    ]
    root = root_cause(exits)
    assert root is not None and root.rank == 1
    summary = format_summary(exits, prog="aiodist.run", node_rank=0, restarts=1, max_restarts=1)
    assert "restarts used: 1 of 1" in summary
    others = _others(summary)
    assert "stopped by the launcher (SIGTERM): killed by SIGTERM (exit code -15)" in others[0]
    assert "succeeded (exit code 0)" in others[2]


def test_ties_go_to_the_rank_that_failed_for_a_reason_of_its_own_then_to_the_first() -> None:
    exits = [_exit(0, "RuntimeError: disk full", at=2.0), _exit(1, "ValueError: nan loss", at=1.0)]
    assert root_cause(exits) == exits[1]
    exits = [_exit(0, "OSError: disk full", at=1.0), _exit(1, "DistNetworkError: rank 5 closed", at=0.5)]
    assert root_cause(exits) == exits[0]  # rank 1 points at a rank of another node


def test_a_root_cause_pointing_at_another_node_says_so() -> None:
    exits = [_exit(2, "DistNetworkError: rank 1 closed its connection"), _exit(3, None, code=-15, stopped=15)]
    summary = format_summary(exits, prog="aiodist.run", node_rank=1, restarts=0, max_restarts=0)
    assert summary_field(summary, "rank").startswith("2 (local_rank 2, node 1")
    assert "its error points at rank 1, which runs on another node" in summary


# -- reading a worker's stderr --------------------------------------------------------------------

_AIODIST = str(Path(__file__).resolve().parents[2] / "aiodist")
_STDERR = f"""\
some output before
Traceback (most recent call last):
  File "{_AIODIST}/group.py", line 299, in _body
    result = await coro
             ^^^^^^^^^^
aiodist.errors.DistNetworkError: rank 1 has left the job

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/home/me/train.py", line 40, in <module>
    main()
  File "/home/me/train.py", line 31, in main
    dist.all_reduce(grad)
  File "{_AIODIST}/sync/_bridge.py", line 44, in call
    return lt.call_until_done(lambda: fn()._future)
  File "/usr/lib/python3.11/concurrent/futures/_base.py", line 456, in result
    return self.__get_result()
  File "/usr/lib/python3.11/asyncio/tasks.py", line 277, in __step
    result = coro.send(None)
aiodist.errors.DistNetworkError: all_reduce #3 on rank 0 failed: rank 1 has left the job
""".splitlines()


def test_compress_frames_keeps_the_users_frames_and_counts_the_rest() -> None:
    lines, hidden = compress_frames(_STDERR)
    assert hidden == 4
    text = "\n".join(lines)
    assert '  File "/home/me/train.py", line 31, in main\n    dist.all_reduce(grad)\n' in text
    assert "    dist.all_reduce(grad)\n  (3 aiodist/asyncio frames hidden)\naiodist.errors" in text
    assert "Traceback (most recent call last):\n  (1 aiodist/asyncio frame hidden)\naiodist.errors" in text
    assert "_bridge" not in text and "concurrent" not in text and "^^^" not in text


def test_error_line_is_the_last_exception_line() -> None:
    assert error_line(_STDERR) == (
        "aiodist.errors.DistNetworkError: all_reduce #3 on rank 0 failed: rank 1 has left the job"
    )
    assert error_line(["warming up", "Killed", ""]) == "Killed"
    assert error_line([]) is None


def test_blamed_rank_is_the_first_other_rank_named() -> None:
    assert blamed_rank("all_reduce on rank 0: rank 2 abandoned all_reduce: rank 1 left", own_rank=0) == 2
    assert blamed_rank("Rank 3 failed to pass monitoredBarrier", own_rank=0) == 3
    assert blamed_rank("ranks 0 and 4 never entered barrier #2", own_rank=0) == 4
    assert blamed_rank("rank 2 ran out of memory", own_rank=2) is None
