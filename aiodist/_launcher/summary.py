"""What the launcher tells the user when workers fail (pure: classification and formatting, no I/O).

Every worker of the failed attempt ends in one of three ways (:attr:`WorkerExit.ending`):

- **failed on its own**: a non-zero exit code, or a signal the launcher did not send (the OOM
  killer's SIGKILL, a segfault);
- **stopped by the launcher**: it was still running when the launcher signalled it;
- **succeeded**: exit code 0.

The root cause is one of the workers that failed on their own or, when every one of them only
reports a failure elsewhere, the rank of another node that their errors lead to; :func:`root_cause`
says which.
"""

from __future__ import annotations

import enum
import signal
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from aiodist._launcher.tracebacks import disagreement, named_ranks

__all__ = [
    "CLOSE_EXITS",
    "Ending",
    "RootCause",
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

    @property
    def killed(self) -> bool:
        """True if a signal the launcher did not send ended it (the OOM killer's SIGKILL, a
        segfault), SIGABRT aside: a program aborts itself after saying why ("Fatal Python error")."""
        return self.returncode < 0 and self.stopped_by is None and -self.returncode != signal.SIGABRT

    def named(self) -> list[int]:
        """The other ranks its error names, in order; none for a :attr:`killed` worker, whose last
        line of stderr is not why it ended."""
        if self.error is None or self.killed:
            return []
        return named_ranks(self.error, own_rank=self.rank)

    def blames(self) -> int | None:
        """The other rank its error points at (the first it names), or None: errors such as
        "rank 2 abandoned all_reduce" or "rank 1 closed its connection" report another's failure."""
        named = self.named()
        return named[0] if named else None


def _named(worker: WorkerExit, world_size: int | None) -> list[int]:
    """The ranks of the job that ``worker``'s error names, in order (a number past the world size,
    as in "expected a rank 3 tensor" in a job of 2, names none)."""
    return [r for r in worker.named() if world_size is None or r < world_size]


def _blames(worker: WorkerExit, world_size: int | None) -> int | None:
    named = _named(worker, world_size)
    return named[0] if named else None


def _leads(exits: Sequence[WorkerExit], world_size: int | None) -> dict[int, int]:
    """rank -> the rank its error leads to, for each worker whose error points at another rank
    (see :func:`root_cause`)."""
    here = {e.rank: e for e in exits}
    leads: dict[int, int] = {}
    for voter in exits:
        chain = [voter.rank]
        speaker = voter  # the worker whose error the chain is reading
        target = _blames(voter, world_size)
        while target is not None and target not in chain:
            chain.append(target)
            if target in here:
                speaker = here[target]
                target = _blames(speaker, world_size)
            else:
                # A rank of another node: the rest of the error names what it reported in turn.
                named = _named(speaker, world_size)
                after = named.index(target) + 1
                target = named[after] if after < len(named) else None
        if target is not None:
            # Back at a rank already on the chain (a loop): stop at it, or one further if it is the voter.
            chain = chain[: max(chain.index(target), 1) + 1]
        if len(chain) > 1:
            leads[voter.rank] = chain[-1]
    return leads


def _votes(leads: dict[int, int]) -> dict[int, list[int]]:
    """rank -> the ranks whose errors lead to it, from :func:`_leads`."""
    votes: dict[int, list[int]] = {}
    for voter, rank in leads.items():
        votes.setdefault(rank, []).append(voter)
    return votes


@dataclass(frozen=True, slots=True)
class RootCause:
    """The rank a failure summary names as the root cause.

    Attributes:
        rank: its global rank.
        worker: the worker of this node the summary shows: the root cause itself or, when that
            runs on another node (:attr:`remote`), the worker of this node whose error says so.
        led_by: the ranks whose errors lead to it, in rank order.
    """

    rank: int
    worker: WorkerExit
    led_by: tuple[int, ...] = ()

    @property
    def remote(self) -> bool:
        """True if the root cause runs on another node (its error is in that node's summary)."""
        return self.rank != self.worker.rank

    def one_line(self) -> str:
        """``rank 1 (local_rank 1, pid 4242): exit code 1: ValueError: ...``; for a rank of
        another node, ``rank 3, on another node; seen here by rank 0 (...): ...``."""
        line = self.worker.one_line()
        if self.worker.error:
            line += f": {self.worker.error}"
        return f"rank {self.rank}, on another node; seen here by {line}" if self.remote else line


def root_cause(exits: Sequence[WorkerExit], *, world_size: int | None = None) -> RootCause | None:
    """The rank whose failure the others' follow from; None if no worker failed on its own.

    The rule: each worker's error points at the first other rank it names ("rank 2 abandoned
    all_reduce #1: rank 1 has left the job" points at rank 2); a worker killed by a signal the
    launcher did not send points nowhere, whatever it wrote last. Follow the pointers from worker
    to worker until a rank whose error points nowhere (it failed for a reason of its own), a rank
    already on the chain (two ranks that blame each other, as both sides of a mismatch do: the
    chain stops at the first of the two it reached, never at the worker it started from), or a
    rank whose error is not known here. At a rank of another node, the chain reads on in the
    error that named it: the next rank that error names is the one that rank reported ("rank 2
    abandoned all_reduce #1: rank 1 has left the job" leads to rank 1 through rank 2). Each chain
    is one vote for the rank it stops at.

    The workers that count are those that failed on their own and exited within
    ``CLOSE_EXITS`` seconds of the first of them (a failure reaches the other ranks within
    milliseconds, so exit order alone is a race). When the chain of every one of them ends at
    a rank of another node, none of them failed for a reason of its own: the root cause is the
    rank of another node with the most votes (on a tie, the one reached by the first to exit),
    shown through the worker here whose error names it first, else the first to exit. Otherwise
    the root cause is the one of them with the most votes; on a tie, one whose error points
    nowhere (killed by a signal, or an error that names no other rank), then the first to exit.

    ``world_size``, when given, is the job's: a number its errors name past it is no rank.
    """
    failed = [e for e in exits if e.ending is Ending.FAILED]
    if not failed:
        return None
    first = min(e.exit_time for e in failed)
    close = [e for e in failed if e.exit_time <= first + CLOSE_EXITS]
    leads = _leads(exits, world_size)
    votes = _votes(leads)
    here = {e.rank for e in exits}
    if all(leads.get(e.rank, e.rank) not in here for e in close):
        reached = {leads[e.rank] for e in close}
        rank = min(
            reached,
            key=lambda r: (-len(votes[r]), min(e.exit_time for e in close if leads[e.rank] == r), r),
        )
        worker = min(
            (e for e in close if leads[e.rank] == rank),
            key=lambda e: (_blames(e, world_size) != rank, e.exit_time, e.rank),
        )
        return RootCause(rank, worker, tuple(sorted(votes[rank])))
    worker = min(
        close,
        key=lambda e: (-len(votes.get(e.rank, ())), _blames(e, world_size) is not None, e.exit_time),
    )
    return RootCause(worker.rank, worker, tuple(sorted(votes.get(worker.rank, ()))))


def _timestamp(epoch: float) -> str:
    return datetime.fromtimestamp(epoch).astimezone().isoformat(timespec="milliseconds")


def _clock(epoch: float) -> str:
    return datetime.fromtimestamp(epoch).strftime("%H:%M:%S.%f")[:-3]


def _why(root: RootCause, exits: Sequence[WorkerExit]) -> str:
    if root.remote:
        reasons = ["on another node"]
    else:
        others = [e.exit_time for e in exits if e is not root.worker and e.ending is Ending.FAILED]
        first = all(root.worker.exit_time < t for t in others)
        reasons = ["the first to fail on its own" if first else "failed on its own"]
    voters = root.led_by
    if len(voters) == 1:
        reasons.append(f"the error of rank {voters[0]} leads to it")
    elif voters:
        reasons.append(f"the errors of ranks {_list(voters)} lead to it")
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
    world_size: int | None = None,
) -> str:
    """The report printed to stderr when the group failed and no restart is left.

    ``exits`` holds every worker of the failed attempt on this node. The root cause is chosen by
    :func:`root_cause` (the first worker to exit with an error when none failed on its own, which
    only happens if the launcher was signalled at the same moment). When it runs on another node,
    the summary says so and shows the worker of this node whose error leads to it. ``world_size``:
    as for :func:`root_cause`.
    """
    cause = root_cause(exits, world_size=world_size)
    if cause is None:
        fallback = min((e for e in exits if e.returncode != 0), key=lambda e: e.exit_time, default=exits[0])
        cause = RootCause(fallback.rank, fallback)
    root = cause.worker
    where = f"(local_rank {root.local_rank}, node {node_rank}, host {socket.gethostname()})"
    lines = [
        _RULE,
        f"{prog}: worker group failed (restarts used: {restarts} of {max_restarts})",
        _THIN,
        f"Root cause: rank {cause.rank} ({_why(cause, exits)})",
    ]
    if cause.remote:
        lines += [
            f"  rank      : {cause.rank}, on another node: its own error is in that node's launcher output",
            f"  seen by   : rank {root.rank} {where}",
        ]
    else:
        lines.append(f"  rank      : {root.rank} {where}")
    lines += [
        f"  pid       : {root.pid}",
        f"  exit      : {describe_exit(root.returncode)}",
        f"  time      : {_timestamp(root.exit_time)}",
        f"  error     : {root.error or '(it wrote nothing to stderr)'}",
    ]
    blamed = None if cause.remote else _blames(root, world_size)
    if blamed is not None and blamed not in {e.rank for e in exits}:
        lines.append(
            f"  note      : its error points at rank {blamed}, which runs on another node: "
            "see that node's launcher output"
        )
    # Read from the root's own error: whichever of the two sides learned of the disagreement
    # first, and from whom, the other side's error may name a bystander that relayed it.
    sides = None if cause.remote else disagreement(root.error or "")
    if sides is not None and root.rank in sides:
        other = sides[1] if sides[0] == root.rank else sides[0]
        lines.append(
            f"  note      : ranks {root.rank} and {other} disagree (one expected an operation the other did "
            "not send): the one that deviates may be either"
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
