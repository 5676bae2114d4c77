"""What the launcher tells the user when workers fail (pure: classification and formatting, no I/O).

Every worker of the failed attempt ends in one of three ways (:attr:`WorkerExit.ending`):

- **failed on its own**: a non-zero exit code, or a signal the launcher did not send (the OOM
  killer's SIGKILL, a segfault);
- **stopped by the launcher**: it was still running when the launcher signalled it;
- **succeeded**: exit code 0.

The root cause is one of the workers that failed on their own; :func:`root_cause` says which.
"""

from __future__ import annotations

import enum
import signal
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from aiodist._launcher.tracebacks import blamed_rank

__all__ = [
    "CLOSE_EXITS",
    "Ending",
    "WorkerExit",
    "describe_exit",
    "format_summary",
    "root_cause",
    "signal_name",
]

_RULE = "=" * 72
_THIN = "-" * 72
#: Failures that exit within this many seconds of the first one count as simultaneous (see root_cause).
CLOSE_EXITS = 2.0


def signal_name(signum: int) -> str:
    """``"SIGKILL"`` for 9; ``"signal 42"`` for a number without a name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(returncode: int) -> str:
    """Human form of a ``Popen.returncode``: negative values are deaths by signal."""
    if returncode < 0:
        return f"killed by {signal_name(-returncode)} (exit code {returncode})"
    return f"exit code {returncode}"


class Ending(enum.Enum):
    """How a worker's run ended (see the module docstring)."""

    FAILED = "failed on its own"
    STOPPED = "stopped by the launcher"
    SUCCEEDED = "succeeded"


@dataclass(frozen=True, slots=True)
class WorkerExit:
    """One worker of an attempt after it ended.

    Attributes:
        rank: global rank. local_rank: index on this node. pid: its process id.
        returncode: as ``Popen.returncode`` (negative: killed by that signal).
        exit_time: wall-clock seconds since the epoch when the launcher saw it exited (it looks
            every ``--monitor-interval`` seconds).
        stopped_by: the signal the launcher sent it while it was running, or None.
        error: the one line that says what went wrong (its last exception line), if any.
        stderr_tail: the last lines of its stderr, internal traceback frames folded.
        hidden_frames: how many internal frames the folding hid.
        stderr_log: its stderr log file, if one was written.
    """

    rank: int
    local_rank: int
    pid: int
    returncode: int
    exit_time: float
    stopped_by: int | None = None
    error: str | None = None
    stderr_tail: tuple[str, ...] = ()
    hidden_frames: int = 0
    stderr_log: Path | None = None

    @property
    def ending(self) -> Ending:
        """Failed on its own, stopped by the launcher, or succeeded."""
        if self.stopped_by is not None:
            return Ending.STOPPED
        return Ending.SUCCEEDED if self.returncode == 0 else Ending.FAILED

    def one_line(self) -> str:
        """``rank 1 (local_rank 1, pid 4242): exit code 1``."""
        return f"rank {self.rank} (local_rank {self.local_rank}, pid {self.pid}): {describe_exit(self.returncode)}"

    def blames(self) -> int | None:
        """The other rank its error points at (the first it names), or None: errors such as
        "rank 2 abandoned all_reduce" or "rank 1 closed its connection" report another's failure."""
        return blamed_rank(self.error, own_rank=self.rank) if self.error else None


def _votes(exits: Sequence[WorkerExit]) -> dict[int, list[int]]:
    """rank -> the ranks whose errors lead to it (see :func:`root_cause`)."""
    points = {e.rank: e.blames() for e in exits}
    votes: dict[int, list[int]] = {}
    for voter in exits:
        chain = [voter.rank]
        target = points[voter.rank]
        while target is not None and target not in chain:
            chain.append(target)
            target = points.get(target)
        if target is not None:
            # Back at a rank already on the chain (a loop): stop at it, or one further if it is the voter.
            chain = chain[: max(chain.index(target), 1) + 1]
        if len(chain) > 1:
            votes.setdefault(chain[-1], []).append(voter.rank)
    return votes


def root_cause(exits: Sequence[WorkerExit]) -> WorkerExit | None:
    """The worker whose failure the others' follow from; None if no worker failed on its own.

    The rule: each worker's error points at the first other rank it names ("rank 2 abandoned
    all_reduce #1: rank 1 has left the job" points at rank 2). Follow the pointers from worker to
    worker until a rank whose error points nowhere (it failed for a reason of its own), a rank
    whose error is not known here, or a rank already on the chain (two ranks that blame each
    other, as both sides of a mismatch do: the chain stops at the first of the two it reached,
    never at the worker it started from). Each chain is one vote for the rank it stops at.
    Among the workers that failed on their own and exited within ``CLOSE_EXITS`` seconds of the
    first of them (a failure reaches the other ranks within milliseconds, so exit order alone is a
    race), the root cause has the most votes; on a tie, it is one whose error points nowhere, then
    the first to exit.
    """
    failed = [e for e in exits if e.ending is Ending.FAILED]
    if not failed:
        return None
    first = min(e.exit_time for e in failed)
    close = [e for e in failed if e.exit_time <= first + CLOSE_EXITS]
    votes = _votes(exits)
    return min(close, key=lambda e: (-len(votes.get(e.rank, ())), e.blames() is not None, e.exit_time))


def _timestamp(epoch: float) -> str:
    return datetime.fromtimestamp(epoch).astimezone().isoformat(timespec="milliseconds")


def _clock(epoch: float) -> str:
    return datetime.fromtimestamp(epoch).strftime("%H:%M:%S.%f")[:-3]


def _why(root: WorkerExit, exits: Sequence[WorkerExit]) -> str:
    voters = sorted(_votes(exits).get(root.rank, ()))
    others = [e.exit_time for e in exits if e is not root and e.ending is Ending.FAILED]
    reasons = [
        "the first to fail on its own" if all(root.exit_time < t for t in others) else "failed on its own"
    ]
    if voters:
        reasons.append(f"the errors of rank{'s' if len(voters) > 1 else ''} {_list(voters)} lead to it")
    return "; ".join(reasons)


def _list(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))


def _other_line(worker: WorkerExit) -> str:
    head = f"  rank {worker.rank} (local_rank {worker.local_rank}, pid {worker.pid}): "
    if worker.ending is Ending.STOPPED:
        assert worker.stopped_by is not None  # (Ending.STOPPED means it was signalled)
        said = f"; its last error: {worker.error}" if worker.error else ""
        return f"{head}stopped by the launcher ({signal_name(worker.stopped_by)}): {describe_exit(worker.returncode)}{said}"
    if worker.ending is Ending.SUCCEEDED:
        return f"{head}succeeded (exit code 0) at {_clock(worker.exit_time)}"
    error = f": {worker.error}" if worker.error else " (it wrote nothing to stderr)"
    return f"{head}failed on its own, {describe_exit(worker.returncode)} at {_clock(worker.exit_time)}{error}"


def format_summary(
    exits: Sequence[WorkerExit],
    *,
    prog: str,
    node_rank: int,
    restarts: int,
    max_restarts: int,
) -> str:
    """The report printed to stderr when the group failed and no restart is left.

    ``exits`` holds every worker of the failed attempt on this node. The root cause is chosen by
    :func:`root_cause` (the first worker to exit with an error when none failed on its own, which
    only happens if the launcher was signalled at the same moment).
    """
    root = root_cause(exits) or min(
        (e for e in exits if e.returncode != 0), key=lambda e: e.exit_time, default=exits[0]
    )
    lines = [
        _RULE,
        f"{prog}: worker group failed (restarts used: {restarts} of {max_restarts})",
        _THIN,
        f"Root cause: rank {root.rank} ({_why(root, exits)})",
        f"  rank      : {root.rank} (local_rank {root.local_rank}, node {node_rank}, host {socket.gethostname()})",
        f"  pid       : {root.pid}",
        f"  exit      : {describe_exit(root.returncode)}",
        f"  time      : {_timestamp(root.exit_time)}",
        f"  error     : {root.error or '(it wrote nothing to stderr)'}",
    ]
    blamed = root.blames()
    if blamed is not None and blamed not in {e.rank for e in exits}:
        lines.append(
            f"  note      : its error points at rank {blamed}, which runs on another node: "
            "see that node's launcher output"
        )
    if blamed is not None and root.rank == next((e.blames() for e in exits if e.rank == blamed), None):
        lines.append(
            f"  note      : ranks {root.rank} and {blamed} blame each other (their operations disagree): "
            "the one that deviates may be either"
        )
    if root.stderr_log is not None:
        lines.append(f"  log       : {root.stderr_log}")
    if root.stderr_tail:
        hidden = f", {root.hidden_frames} aiodist/asyncio frames hidden" if root.hidden_frames else ""
        lines.append(f"  stderr    : last {len(root.stderr_tail)} lines{hidden}:")
        lines.extend(f"    | {line}" for line in root.stderr_tail)
    others = sorted((e for e in exits if e is not root), key=lambda e: e.rank)
    lines.append("Other workers on this node:" if others else "Other workers on this node: none")
    lines.extend(_other_line(worker) for worker in others)
    lines.append(_RULE)
    return "\n".join(lines) + "\n"
