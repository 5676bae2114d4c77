"""Turning the ranks' reports into one job's rows, printing each table row as its case completes.

Every rank of a job reports plain tuples (``worker.Worker.emit``): ``("case" | "latency", rank,
op, nbytes, count, {runtime: (seconds per repetition, wrong)})``, ``("memory", rank, runtime,
nbytes, added)``. A row exists once every rank has reported its case. The spawned jobs
(``cli.run_job``, items from a queue) and the launched ones (``launched``, items gathered to
rank 0) feed them to the same ``JobCollector``, so both print and save the same tables.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from aiodist.bench import cases, report

__all__ = ["JobCollector"]


class JobCollector:
    """Collects one job's reports into ``job`` (its ``rows``, ``latency`` and ``memory``).

    Args:
        job: the job's record; rows are appended to ``job["rows"]`` and ``job["latency"]``.
        nprocs: ranks in the job (a row is complete when each has reported).
        impls: the tables' columns in order (aiodist's name first, then the peers).
        in_process: how many runtimes each rank measures itself (the memory probe is complete
            when each has reported on every rank).
        say: prints a line of the tables.
        step: hears of every finished case (the progress line).
        mpi: the MPI peer's figures from a job of its own (``mpi.run_mpi_job``), joined to the
            rows as the ``mpi`` column; None where MPI is not measured that way.
        latency: whether the job measures the latency rows.
    """

    def __init__(
        self,
        job: dict[str, Any],
        nprocs: int,
        impls: Sequence[str],
        *,
        in_process: int,
        say: Callable[[str], None],
        step: Callable[[str], None],
        mpi: dict[str, Any] | None = None,
        latency: bool = True,
    ) -> None:
        self.job = job
        self.n = nprocs
        self.impls = list(impls)
        self.in_process = in_process
        self.say = say
        self.step = step
        self.mpi = mpi
        self._per_rank = report.RankReports(nprocs)
        self._memory: dict[str, dict[int, int]] = {}
        self._header_for: str | None = None
        self._latency_left = len(cases.LATENCY) if latency else 0

    def take(self, item: Sequence[Any]) -> None:
        """One report of one rank (``"case"``, ``"latency"`` or ``"memory"``; others are ignored)."""
        kind = item[0]
        if kind == "memory":
            self._take_memory(item)
        elif kind in ("case", "latency"):
            self._take_case(item)

    def _take_memory(self, item: Sequence[Any]) -> None:
        _, rank, name, nbytes, added = item
        self._memory.setdefault(name, {})[rank] = added
        if len(self._memory) < self.in_process or any(len(v) < self.n for v in self._memory.values()):
            return
        job, mpi = self.job, self.mpi
        job["memory"] = {k: [v[r] for r in range(self.n)] for k, v in self._memory.items()}
        if mpi and mpi.get("memory"):
            job["memory"]["mpi"] = mpi["memory"]
        self.say(report.format_memory(job["memory"], nbytes))
        self.step("memory probe")

    def _take_case(self, item: Sequence[Any]) -> None:
        kind, _, op, nbytes = item[:4]
        if (complete := self._per_rank.add(item)) is None:
            return
        count, reports = complete
        mpi = self.mpi
        if kind == "latency":
            lrow = report.latency_row(op, nbytes, self.n, reports)
            if mpi and op in mpi["latency"]:
                lrow["impls"]["mpi"] = mpi["latency"][op]
                report.add_latency_ratios(lrow)
            self.job["latency"].append(lrow)
            self._latency_left -= 1
            if self._latency_left == 0:
                self.say(report.format_latency(self.job["latency"], self.impls))
            self.step(lrow["case"])
            return
        row = report.aggregate(op, nbytes, count, self.n, reports)
        if mpi and (op, nbytes) in mpi["rows"]:
            row["impls"]["mpi"] = mpi["rows"][(op, nbytes)]
            report.add_ratios(row)
        self.job["rows"].append(row)
        if self._header_for != op:
            self._header_for = op
            self.say(report.format_table_header(op, self.impls))
        self.say(report.format_table_row(row, self.impls))
        self.step(f"{op} {report.size_text(row['size'])}")
