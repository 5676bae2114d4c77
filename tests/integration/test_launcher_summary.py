"""The launcher's failure summary: which rank it blames, how it lists the others, the traceback tail.

The first tests run real jobs (``aiodist.sync`` workers under ``aiodist.run``) where rank 1 goes
wrong while the others are in a collective; the rest pin the rule on hand-made exits.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
from support.launcher import SCRIPTS, launch, summary_field, summary_of

from aiodist._launcher.relay import Tail
from aiodist._launcher.summary import WorkerExit, format_summary, root_cause
from aiodist._launcher.supervisor import _poll, _Worker
from aiodist._launcher.tracebacks import blamed_rank, compress_frames, error_line, named_ranks

pytestmark = pytest.mark.timeout(90)

JOB = str(SCRIPTS / "collective_fault.py")


def _others(summary: str) -> dict[int, str]:
    """rank -> its line under "Other workers on this node"."""
    block = summary.split("Other workers on this node:", 1)[1]
    return {int(m.group(1)): m.group(0) for m in re.finditer(r"^  rank (\d+) \(.*$", block, re.MULTILINE)}


def _run_job(tmp_path: Path, mode: str, *, nproc: int = 3, flags: tuple[str, ...] = ()) -> str:
    proc = launch(["--standalone", "--nproc-per-node", str(nproc), *flags, JOB, mode], tmp_path, timeout=60)
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
    assert "ranks 0 and 1 disagree" in summary or "ranks 1 and 0 disagree" in summary
    # The user's line survives the folding of the aiodist/asyncio frames; the internals do not.
    assert "dist.all_reduce(np.ones(count, np.float32))" in summary
    assert re.search(r"\(\d+ aiodist/asyncio frames? hidden\)", summary), summary
    assert "_bridge.py" not in summary and "_loop_thread.py" not in summary
    assert all("failed on its own" in line for line in _others(summary).values()), summary
    assert "stopped by the launcher" not in summary


def test_a_sigkilled_rank_seen_in_one_poll_with_its_peer_is_the_root_cause(tmp_path: Path) -> None:
    """Rank 1 writes a line naming rank 0, then SIGKILLs itself; rank 0's error names rank 1.

    A 1 s monitor interval makes the launcher see both exits in one poll: the line rank 1
    wrote last is not why it ended, and the order in which one poll looks at the workers is not
    the order in which they exited.
    """
    summary = _run_job(tmp_path, "kill", nproc=2, flags=("--monitor-interval", "1"))
    assert re.search(r"^Root cause: rank 1 \(.*the error of rank 0 leads to it\)$", summary, re.M), summary
    assert summary_field(summary, "exit") == "killed by SIGKILL (exit code -9)"
    assert "rank 1 closed its connection" in _others(summary)[0], summary


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
    assert not root.remote and root.worker is exits[1] and root.led_by == (0, 2, 3)


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


def test_the_two_sides_of_a_mismatch_are_named_when_one_heard_of_it_through_a_bystander() -> None:
    # Rank 0 heard of the mismatch first through rank 2's notice, so its error names rank 2 first.
    fingerprint = (
        "rank 1 expected all_reduce #1 (float32 x 20, sum) but rank 0 sent all_reduce #1 (float32 x 10, sum)"
    )
    relayed = f"rank 1 abandoned all_reduce #1: {fingerprint}"
    exits = [
        _exit(0, f"CollectiveMismatchError: rank 2 abandoned all_reduce #1: {relayed}"),
        _exit(1, f"CollectiveMismatchError: {fingerprint}"),
        _exit(2, f"CollectiveMismatchError: {relayed}"),
    ]
    root = root_cause(exits)
    assert root is not None and root.rank in (0, 1)
    summary = format_summary(exits, prog="aiodist.run", node_rank=0, restarts=0, max_restarts=0)
    other = 1 - root.rank
    assert f"note      : ranks {root.rank} and {other} disagree" in summary, summary


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
    root = root_cause(exits)
    assert root is not None and root.worker == exits[1]
    exits = [_exit(0, "OSError: disk full", at=1.0), _exit(1, "DistNetworkError: rank 5 closed", at=0.5)]
    root = root_cause(exits)
    # Rank 1 points at a rank of another node, but rank 0 failed here for a reason of its own.
    assert root is not None and root.worker == exits[0] and not root.remote


# -- exits seen in one poll: a rank killed by a signal, one whose error names no other rank ----------

_CLOSED = (
    "DistNetworkError: all_reduce #4 on rank 0 failed: rank 1 closed its connection without saying goodbye"
)


@pytest.mark.parametrize("rank_0_first", [False, True], ids=["same-time", "rank-0-stamped-first"])
def test_a_rank_killed_by_a_signal_outranks_the_rank_whose_error_names_it(rank_0_first: bool) -> None:
    # Rank 1 was SIGKILLed; the last line it wrote happens to name rank 0. Both exits were seen in
    # one poll (before, each was stamped as the poll looked at it: rank 0 a microsecond first).
    exits = [
        _exit(0, _CLOSED, at=100.0 - (1e-6 if rank_0_first else 0.0)),
        _exit(1, "rank 1: rank 0 is waiting for my gradients", code=-9, at=100.0),
    ]
    root = root_cause(exits)
    assert root is not None and root.worker is exits[1] and root.led_by == (0,)
    summary = format_summary(exits, prog="aiodist.run", node_rank=0, restarts=0, max_restarts=0)
    assert "Root cause: rank 1 (failed on its own; the error of rank 0 leads to it)" in summary, summary
    assert "disagree" not in summary


def test_one_poll_stamps_every_exit_it_sees_with_one_time() -> None:
    processes = [SimpleNamespace(returncode=code) for code in (None, 1, -9)]
    workers = [
        _Worker(i, i, cast(asyncio.subprocess.Process, p), Tail(), None, []) for i, p in enumerate(processes)
    ]
    # Rank 0 still runs: the ranks after it are stamped all the same, in this poll.
    assert _poll(workers) == workers[1:]
    stamped = workers[1].exit_time
    assert stamped is not None and workers[2].exit_time == stamped and workers[0].exit_time is None
    processes[0].returncode = 1
    assert _poll(workers) == workers
    assert workers[0].exit_time is not None and workers[0].exit_time >= stamped
    assert workers[1].exit_time == workers[2].exit_time == stamped


def test_a_killed_rank_is_where_every_chain_stops() -> None:
    # Rank 2 names rank 0 first (rank 0 abandoned the operation): its chain goes on through rank 0
    # to rank 1, and stops there although the line rank 1 wrote last names rank 0.
    exits = [
        _exit(0, _CLOSED),
        _exit(1, "rank 1: rank 0 is waiting for my gradients", code=-9),
        _exit(2, "DistNetworkError: rank 0 abandoned all_reduce #4: rank 1 closed its connection"),
    ]
    root = root_cause(exits)
    assert root is not None and root.rank == 1 and root.led_by == (0, 2)


def test_an_abort_and_a_launchers_signal_keep_what_the_worker_said() -> None:
    # SIGABRT follows the program's own account of why; a worker the launcher stopped keeps its last error.
    aborted = _exit(0, "Fatal Python error: rank 1 sent a corrupt frame", code=-6)
    stopped = _exit(2, "DistTimeoutError: waiting for data from rank 1", code=-9, stopped=9)
    killed = _exit(3, "rank 3 waits for rank 1", code=-9)
    assert (aborted.killed, stopped.killed, killed.killed) == (False, False, True)
    assert (aborted.blames(), stopped.blames(), killed.blames()) == (1, 1, None)


def test_in_one_poll_an_error_that_names_no_rank_outranks_one_that_does() -> None:
    exits = [_exit(0, "DistNetworkError: rank 7 closed its connection"), _exit(1, "MemoryError")]
    root = root_cause(exits)
    assert root is not None and root.worker is exits[1] and not root.remote


# -- several nodes: the ranks here only saw a failure elsewhere ------------------------------------

_RAISED = "rank 3 exited with an uncaught exception (ValueError: rank 3 fails on purpose at step 10)"


def test_ranks_that_only_saw_a_failure_on_another_node_name_that_rank() -> None:
    # Node 0 (ranks 0, 1) of two; rank 3, on node 1, raised. Rank 1 heard of it through rank 0.
    exits = [
        _exit(0, f"DistNetworkError: all_reduce #10 on rank 0 failed: {_RAISED}", at=5.0),
        _exit(1, f"DistNetworkError: rank 0 abandoned all_reduce #10: {_RAISED}", at=5.0),
    ]
    root = root_cause(exits)
    assert root is not None and root.rank == 3 and root.remote
    assert root.worker is exits[0] and root.led_by == (0, 1)
    assert root.one_line().startswith("rank 3, on another node; seen here by rank 0 (local_rank 0, pid 1000)")
    summary = format_summary(exits, prog="aiodist.run", node_rank=0, restarts=0, max_restarts=0)
    assert re.search(
        r"^Root cause: rank 3 \(on another node; the errors of ranks 0, 1 lead to it\)$", summary, re.M
    )
    assert summary_field(summary, "rank").startswith("3, on another node: its own error is in that node's")
    assert summary_field(summary, "seen by").startswith("rank 0 (local_rank 0, node 0, host ")
    assert summary_field(summary, "error") == exits[0].error
    assert "on its own" not in summary.split("Other workers on this node")[0], summary
    assert "note" not in summary  # no "points at another node" note: the root cause is that rank
    assert sorted(_others(summary)) == [1]


def test_a_rank_of_another_node_that_relayed_a_loss_is_not_the_root_cause() -> None:
    # Node 0 of three (one rank each): rank 1's host died; rank 0 heard of it first from rank 2.
    exits = [_exit(0, "DistNetworkError: rank 2 abandoned all_reduce #8: rank 1 closed its connection")]
    root = root_cause(exits)
    assert root is not None and root.rank == 1 and root.remote and root.led_by == (0,)
    summary = format_summary(exits, prog="aiodist.run", node_rank=0, restarts=0, max_restarts=0)
    assert "Root cause: rank 1 (on another node; the error of rank 0 leads to it)" in summary


def test_across_nodes_the_worker_shown_is_one_whose_error_names_the_root_cause_first() -> None:
    exits = [
        _exit(0, "DistNetworkError: rank 1 abandoned all_reduce #2: rank 6 ran out of memory", at=1.0),
        _exit(1, "DistNetworkError: all_reduce #2 on rank 1 failed: rank 6 ran out of memory", at=1.0),
        _exit(2, "DistNetworkError: rank 5 abandoned all_reduce #2: rank 6 ran out of memory", at=0.9),
    ]
    root = root_cause(exits)
    assert root is not None and root.rank == 6 and root.worker is exits[1] and root.led_by == (0, 1, 2)


def test_across_nodes_the_rank_most_errors_lead_to_wins() -> None:
    exits = [
        _exit(0, "DistNetworkError: rank 4 closed its connection", at=1.0),
        _exit(1, "DistNetworkError: rank 5 closed its connection", at=1.1),
        _exit(2, "DistNetworkError: rank 1 abandoned all_reduce #3: rank 5 closed its connection", at=1.2),
    ]
    root = root_cause(exits)
    assert root is not None and root.rank == 5 and root.worker is exits[1] and root.led_by == (1, 2)
    # On a tie, the rank the first to exit reached.
    root = root_cause(exits[:2])
    assert root is not None and root.rank == 4 and root.worker is exits[0]


def test_a_number_past_the_world_size_is_no_rank_of_another_node() -> None:
    exits = [_exit(0, "ValueError: expected a rank 4 tensor"), _exit(1, None, code=-15, stopped=15)]
    root = root_cause(exits, world_size=2)
    assert root is not None and root.worker is exits[0] and not root.remote and root.led_by == ()
    summary = format_summary(exits, prog="aiodist.run", node_rank=0, restarts=0, max_restarts=0, world_size=2)
    assert "Root cause: rank 0 (the first to fail on its own)" in summary and "another node" not in summary
    root = root_cause(exits, world_size=8)  # in a job of 8, rank 4 may run on another node
    assert root is not None and root.rank == 4 and root.remote


def test_a_failure_of_its_own_here_outranks_a_rank_of_another_node() -> None:
    # Rank 0 names rank 5 of another node; rank 1, here, was SIGKILLed (the OOM killer): that is
    # a failure of this node, which its launcher must report.
    exits = [
        _exit(0, "DistNetworkError: rank 5 closed its connection", at=1.0),
        _exit(1, None, code=-9, at=1.0),
    ]
    root = root_cause(exits)
    assert root is not None and not root.remote and root.worker is exits[1]
    # A stopped worker's error does not count: only those that failed on their own decide.
    exits = [_exit(0, "DistNetworkError: rank 5 closed its connection"), _exit(1, None, code=-15, stopped=15)]
    root = root_cause(exits)
    assert root is not None and root.remote and root.rank == 5


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


def test_named_ranks_lists_each_other_rank_once_in_order() -> None:
    text = "all_reduce #8 on rank 0 failed: rank 2 abandoned all_reduce #8: ranks 1 and 2 closed; rank 0 left"
    assert named_ranks(text, own_rank=0) == [2, 1]
    assert named_ranks("ValueError: nan loss", own_rank=0) == []
