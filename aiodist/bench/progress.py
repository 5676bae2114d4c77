"""A progress line with an ETA for ``aiodist-bench``, on stderr (the tables go to stdout).

On a terminal the line is redrawn in place; otherwise (a log file, a pipe) it is written as
plain lines, at most one every ``interval`` seconds, plus one when a job ends, so a log stays
readable.

The ETA weighs every case by a rough model of its cost (calls x (fixed cost + bytes / rate))
and scales the model by the time the finished cases actually took, so large sizes, which
dominate a run, are not estimated from the speed of the small ones.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TextIO

from aiodist.bench import cases
from aiodist.bench.worker import JobConfig, iterations

__all__ = ["Progress", "case_weight", "format_duration"]

#: Model of one call: a fixed cost plus its bytes at a loopback rate (seconds, bytes/s).
_CALL_FIXED_S = 2e-4
_BYTES_PER_S = 5e8
#: Model of a job's start: spawning its processes, importing torch, the rendezvous.
_JOB_START_S = 3.0


def case_weight(cfg: JobConfig, nbytes: int, *, latency: bool = False) -> float:
    """Modelled seconds of one case: every call it makes, for each runtime measured."""
    impls = 2 if cfg.compare else 1
    if latency:
        calls = max(7, cfg.repeat + 2) * 40
    else:
        warm, iters = iterations(max(nbytes, 1), cfg)
        calls = 1 + warm + cfg.repeat * iters
    return impls * calls * (_CALL_FIXED_S + nbytes / _BYTES_PER_S)


def job_weights(cfg: JobConfig) -> list[float]:
    """The modelled cost of each step of a job, in the order it reports them."""
    steps = [_JOB_START_S]
    if cfg.memory_bytes:
        # Per runtime: one small call, then two of the probe's size.
        impls = 2 if cfg.compare else 1
        steps.append(impls * 3 * (_CALL_FIXED_S + cfg.memory_bytes / _BYTES_PER_S))
    if cfg.latency:
        steps += [case_weight(cfg, nbytes, latency=True) for _, nbytes in cases.LATENCY]
    steps += [case_weight(cfg, nbytes) for _ in cfg.ops for nbytes in cfg.sizes]
    return steps


def format_duration(seconds: float) -> str:
    s = max(0, round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """Counts finished steps across all jobs and shows where the run stands."""

    def __init__(
        self,
        jobs: Sequence[JobConfig],
        *,
        stream: TextIO | None = None,
        enabled: bool = True,
        interval: float = 10.0,
    ) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = enabled
        self._tty = enabled and self._stream.isatty()
        self._interval = interval
        self._weights = [job_weights(cfg) for cfg in jobs]
        self._labels = [cfg.label for cfg in jobs]
        self._total_steps = sum(len(w) - 1 for w in self._weights)
        self._total_weight = sum(sum(w) for w in self._weights)
        self._done_steps = 0
        self._done_weight = 0.0
        self._job = -1
        self._step = 0
        self._t0 = time.monotonic()
        self._last_plain = float("-inf")
        self._shown = False
        self.last_line = ""

    def start_job(self, index: int) -> None:
        """Job ``index`` starts: its start-up cost counts once its first result arrives."""
        self._job, self._step = index, 0
        self._show("starting", force=True)

    def step(self, what: str) -> None:
        """One step of the current job finished (``what``: e.g. ``all_reduce 4 KiB``)."""
        weights = self._weights[self._job]
        if self._step == 0:
            self._done_weight += weights[0]
        self._step += 1
        if self._step < len(weights):
            self._done_weight += weights[self._step]
        self._done_steps += 1
        self._show(what)

    def end_job(self) -> None:
        """The current job ended (finished or failed): its steps not run count as done."""
        weights = self._weights[self._job]
        skipped = len(weights) - 1 - self._step
        if self._step == 0:
            self._done_weight += weights[0]
        self._done_weight += sum(weights[self._step + 1 :])
        self._done_steps += max(0, skipped)
        self._step = len(weights) - 1
        self._show("job done", force=True)

    def eta(self) -> float | None:
        """Seconds left, or None before there is anything to scale the model by."""
        elapsed = time.monotonic() - self._t0
        if self._done_weight <= 0 or elapsed < 0.5:
            return None
        return elapsed * (self._total_weight - self._done_weight) / self._done_weight

    def line(self, what: str) -> str:
        eta = self.eta()
        return (
            f"aiodist-bench: job {self._job + 1}/{len(self._weights)} ({self._labels[self._job]}), "
            f"{what}; {self._done_steps}/{self._total_steps} cases, "
            f"{format_duration(time.monotonic() - self._t0)} elapsed, "
            f"ETA {format_duration(eta) if eta is not None else '--:--'}"
        )

    def _show(self, what: str, *, force: bool = False) -> None:
        self.last_line = self.line(what)
        if not self._enabled:
            return
        if self._tty:
            self._stream.write("\r\x1b[K" + self.last_line)
            self._shown = True
        else:
            now = time.monotonic()
            if not force and now - self._last_plain < self._interval:
                return
            self._last_plain = now
            self._stream.write(self.last_line + "\n")
        self._stream.flush()

    def clear(self) -> None:
        """Take the line off the terminal before something else is printed there."""
        if self._tty and self._shown:
            self._stream.write("\r\x1b[K")
            self._stream.flush()
            self._shown = False

    def close(self) -> None:
        self.clear()
