"""What the launcher tells the user when workers fail (pure formatting, no I/O)."""

from __future__ import annotations

import signal
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

__all__ = ["WorkerFailure", "describe_exit", "format_summary", "signal_name"]

_RULE = "=" * 72
_THIN = "-" * 72


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


@dataclass(frozen=True, slots=True)
class WorkerFailure:
    """One worker that ended with a non-zero exit code or by a signal on its own.

    Attributes:
        rank: global rank. local_rank: index on this node. pid: its process id.
        returncode: as ``Popen.returncode`` (negative: killed by that signal).
        exit_time: wall-clock seconds since the epoch when the launcher saw it exit.
        attempt: 0 for the first run of the group, k after k restarts.
        stderr_tail: the last lines it wrote to stderr.
        stderr_log: its stderr log file, if one was written.
    """

    rank: int
    local_rank: int
    pid: int
    returncode: int
    exit_time: float
    attempt: int
    stderr_tail: tuple[str, ...]
    stderr_log: Path | None = None

    def one_line(self) -> str:
        """``rank 1 (local_rank 1, pid 4242): exit code 1``."""
        return f"rank {self.rank} (local_rank {self.local_rank}, pid {self.pid}): {describe_exit(self.returncode)}"


def _timestamp(epoch: float) -> str:
    return datetime.fromtimestamp(epoch).astimezone().isoformat(timespec="milliseconds")


def format_summary(
    failures: Sequence[WorkerFailure],
    *,
    prog: str,
    node_rank: int,
    restarts: int,
    max_restarts: int,
    stopped: int,
) -> str:
    """The report printed to stderr when the group failed and no restart is left.

    ``failures[0]`` is the root cause (the first failure observed); the others failed on their
    own before the launcher stopped them. ``stopped`` counts the workers the launcher terminated.
    """
    root = failures[0]
    lines = [
        _RULE,
        f"{prog}: worker group failed (restarts used: {restarts} of {max_restarts})",
        _THIN,
        "Root cause (first observed failure):",
        f"  rank      : {root.rank} (local_rank {root.local_rank}, node {node_rank}, host {socket.gethostname()})",
        f"  pid       : {root.pid}",
        f"  exit      : {describe_exit(root.returncode)}",
        f"  time      : {_timestamp(root.exit_time)}",
    ]
    if root.stderr_log is not None:
        lines.append(f"  log       : {root.stderr_log}")
    if root.stderr_tail:
        lines.append(f"  error     : last {len(root.stderr_tail)} lines of its stderr:")
        lines.extend(f"    | {line}" for line in root.stderr_tail)
    else:
        lines.append("  error     : (it wrote nothing to stderr)")
    others = failures[1:]
    lines.append("Other failures:" if others else "Other failures: none")
    lines.extend(f"  {failure.one_line()} at {_timestamp(failure.exit_time)}" for failure in others)
    if stopped:
        lines.append(f"{stopped} other worker(s) were stopped by the launcher.")
    lines.append(_RULE)
    return "\n".join(lines) + "\n"
