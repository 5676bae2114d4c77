"""A launched job: every process was started by a launcher on its node (``aiodist-run``,
``torchrun``, ``mpirun``, ``srun``) and runs one rank, as nccl-tests runs under ``mpirun``.

Each rank runs the same ``Worker`` as a spawned job's: aiodist (one face), and beside it in the
same process, alternating case by case, torch's gloo (``--compare gloo``, its group on the
network) and MPI (``--compare mpi``, where ``mpirun`` started the ranks: see ``bootstrap``).
After every case the ranks send their timings to rank 0 over aiodist (``gather_object``,
outside the timed calls); rank 0 turns them into the same tables, JSON, markdown and plot as a
spawned run, with the hosts the ranks ran on. Other ranks print nothing but their errors.

The launcher decided the world size, so a launched job is one job: one world size, one face,
one aiodist transport. Options that ask for something else are refused (``refusal``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import platform
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from aiodist.bench import hosts, report
from aiodist.bench.bootstrap import BenchSetupError, MpiSession, prepare_environment, start_mpi
from aiodist.bench.collect import JobCollector
from aiodist.bench.launchers import Launch
from aiodist.bench.mpi_worker import MpiRuntime
from aiodist.bench.progress import Progress
from aiodist.bench.worker import ASKED_WORDS, BlockingTorchLike, JobConfig, Worker, join_aiodist

__all__ = ["LaunchedWorker", "measured_options", "options_differ", "refusal", "run_launched"]


def refusal(args: argparse.Namespace, launch: Launch, world_sizes: Sequence[int] | None) -> str | None:
    """Why these options cannot run as this launched job (None: they can).

    ``world_sizes``: what ``-np`` asked for (None: not given).
    """
    by = f"{launch.launcher} started {launch.world_size} ranks ({launch.variables})"
    if world_sizes is not None and list(world_sizes) != [launch.world_size]:
        asked = ",".join(str(n) for n in world_sizes)
        return (
            f"-np {asked}: {by}; in a launched job the launcher decides the world size: "
            f"drop -np, or launch {asked} ranks"
        )
    faces = [f for f in (args.faces or "").split(",") if f.strip()]
    if len(faces) > 1:
        return (
            f"--faces {args.faces}: a launched job measures one face per launch; launch it once with "
            f"--faces {faces[0].strip()} and once with --faces {faces[1].strip()}"
        )
    if len(args.aiodist_transports) > 1:
        return (
            f"--aiodist-transports {','.join(args.aiodist_transports)}: a launched job measures one "
            "transport per launch; launch it once for each"
        )
    for given, flag in ((args.mpiexec, "--mpiexec"), (args.mpi_start_timeout, "--mpi-start-timeout")):
        if given is not None:
            return (
                f"{flag}: the bench starts its own mpiexec only when it spawns the ranks itself; in a "
                "launched job MPI is measured in the launched processes (launch them with mpirun)"
            )
    return None


#: options that may differ between ranks (they measure nothing): how long to wait.
_LOCAL_OPTIONS = ("timeout", "gloo_port")


def measured_options(cfg: JobConfig) -> dict[str, Any]:
    """What a rank measures, as plain data (tuples as lists, as they travel)."""
    data = json.loads(json.dumps(dataclasses.asdict(cfg)))
    return {k: v for k, v in data.items() if k not in _LOCAL_OPTIONS}


def options_differ(everyone: Sequence[dict[str, Any]]) -> str | None:
    """Why the ranks cannot run one job (their ``measured_options`` differ from rank 0's), or None."""
    first = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        diffs = [f"{k} {theirs.get(k)!r} (rank 0: {v!r})" for k, v in first.items() if theirs.get(k) != v]
        if diffs:
            return (
                f"rank {rank} was given other options than rank 0: {'; '.join(diffs)}; every rank of a launched "
                "job must measure the same (give every node the same aiodist-bench options; only --json, "
                "--markdown and --plot matter on rank 0 alone)"
            )
    return None


# -- one rank -------------------------------------------------------------------------------------


class _Outbox:
    """Where a launched rank's ``Worker.emit`` puts its reports until the next gather."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def put(self, item: Any) -> None:
        self.items.append(item)

    def drain(self) -> list[Any]:
        out, self.items = self.items, []
        return out


class _Objects:
    """The object collectives of the face under test, for the bench's own messages (options,
    hosts, reports): outside every timed call."""

    def __init__(self, face: str, rank: int, n: int) -> None:
        import aiodist
        import aiodist.sync

        self.d: Any = aiodist if face == "async" else aiodist.sync
        self.awaits = face == "async"  # the async face returns Works; the sync face blocks
        self.rank, self.n = rank, n

    async def _done(self, started: Any) -> None:
        if self.awaits:
            await started

    async def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj``, on rank 0 (None elsewhere)."""
        out: list[Any] | None = [None] * self.n if self.rank == 0 else None
        await self._done(self.d.gather_object(obj, out, dst=0))
        return out

    async def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.n
        await self._done(self.d.all_gather_object(out, obj))
        return out

    async def broadcast(self, objects: list[Any]) -> None:
        await self._done(self.d.broadcast_object_list(objects, src=0))


class LaunchedWorker(Worker):
    """One rank of a launched job: aiodist first, then gloo and MPI beside it; reports to rank 0.

    ``on_hosts`` (rank 0) hears every rank's host record once all are up; ``collect`` (rank 0)
    every rank's reports after each step.
    """

    def __init__(
        self,
        launch: Launch,
        cfg: JobConfig,
        *,
        mpi: MpiSession | None,
        torch_store: Any,
        on_hosts: Callable[[list[dict[str, Any]]], None] | None,
        collect: Callable[[Sequence[Any]], None] | None,
    ) -> None:
        self.outbox = _Outbox()
        super().__init__(launch.rank, cfg, self.outbox)
        self.launch = launch
        self.mpi = mpi
        self.torch_store = torch_store
        self.on_hosts = on_hosts
        self.collect = collect
        self.objects = _Objects(cfg.face, launch.rank, launch.world_size)
        self._gloo_master: Any = None  # rank 0's torch store for gloo: kept alive with the group

    async def setup(self) -> None:
        cfg, timeout = self.cfg, max(60.0, self.cfg.timeout)
        self.runtimes.append(await join_aiodist(cfg, timeout))
        await self._agree()
        if cfg.compare:
            import torch.distributed as td

            store = self.torch_store if self.torch_store is not None else await self._gloo_store(timeout)
            td.init_process_group(
                "gloo",
                store=store,
                rank=self.rank,
                world_size=self.n,
                timeout=datetime.timedelta(seconds=timeout),
            )
            self.runtimes.append(BlockingTorchLike("gloo", td, use_torch=True))
        if self.mpi is not None:
            self.runtimes.append(MpiRuntime(self.mpi.comm, self.mpi.MPI))
        record = hosts.rank_host(
            self.rank,
            os.environ["MASTER_ADDR"],
            self.launch.local_rank,
            os.environ.get("GLOO_SOCKET_IFNAME") if cfg.compare else None,
        )
        records = await self.objects.gather(record)
        if records is not None and self.on_hosts is not None:
            self.on_hosts(records)

    async def _agree(self) -> None:
        """Every rank measures what rank 0 measures: the same options, or every rank stops here.

        Raises:
            BenchSetupError: some rank was given other options (on every rank, naming them).
        """
        mine = {**measured_options(self.cfg), "mpi": self.mpi is not None}
        everyone = await self.objects.all_gather(mine)
        why = options_differ(everyone)
        if why is not None:
            raise BenchSetupError(why)

    async def _gloo_store(self, timeout: float) -> Any:
        """A torch store for gloo's rendezvous: rank 0 hosts it on a free port of every
        interface (torch's store listens on all) and sends the port over aiodist."""
        from torch._C._distributed_c10d import TCPStore

        wait = datetime.timedelta(seconds=timeout)
        master_addr = os.environ["MASTER_ADDR"]
        port = [0]
        if self.rank == 0:
            self._gloo_master = TCPStore(master_addr, 0, self.n, True, timeout=wait, wait_for_workers=False)
            port = [int(self._gloo_master.port)]
        await self.objects.broadcast(port)
        if self.rank == 0:
            return self._gloo_master
        return TCPStore(master_addr, int(port[0]), self.n, False, timeout=wait)

    async def report(self) -> None:
        gathered = await self.objects.gather(self.outbox.drain())
        if gathered is not None and self.collect is not None:
            for items in gathered:
                self.collect(items)


# -- rank 0: the tables ---------------------------------------------------------------------------


class _Tables:
    """Rank 0's side: the job's record, its banner once the hosts are known, a row per case."""

    def __init__(self, launch: Launch, cfg: JobConfig, progress: Progress) -> None:
        self.launch, self.cfg, self.progress = launch, cfg, progress
        self.impls = [cfg.aiodist_name] + (["gloo"] if cfg.compare else [])
        self.job: dict[str, Any] = {
            "face": cfg.face,
            "nprocs": cfg.nprocs,
            "aiodist": cfg.aiodist_name,
            "transport": cfg.transport,
            "compare": "gloo" if cfg.compare else None,
            "memory_bytes": cfg.memory_bytes,
            "launcher": launch.launcher,
            "rows": [],
            "latency": [],
            "memory": {},
        }
        self.collector: JobCollector | None = None
        self.mpi_note: str | None = None
        self.setup_notes: list[str] = []

    def say(self, text: str) -> None:
        self.progress.clear()
        print(text, flush=True)

    def with_mpi(self, library: str, transport: str) -> None:
        self.impls.append("mpi")
        self.job["mpi"] = {
            "library": library,
            "launcher": f"{self.launch.launcher}: the bench's own processes",
            "transport": transport,
        }

    def without_mpi(self, why: str) -> None:
        self.job["mpi_error"] = why
        self.mpi_note = f"# mpi: not measured: {why}"
        print(f"aiodist-bench: MPI not measured: {why}", file=sys.stderr, flush=True)

    def hosts_known(self, records: list[dict[str, Any]]) -> None:
        place = hosts.placement(records)
        cfg, job = self.cfg, self.job
        job["hosts"] = place["hosts"]
        job["placement"] = place["text"]
        job["ranks"] = records
        if place["notes"]:
            job["notes"] = place["notes"]
        self.say(f"# hosts: {hosts.describe_hosts(place)}")
        for line in self.setup_notes:
            self.say(f"# {line}")
        for note in place["notes"]:
            self.say(f"# note: {note}")
        asked = ASKED_WORDS[cfg.transport]
        beside = (["torch gloo"] if cfg.compare else []) + (["MPI"] if "mpi" in self.impls else [])
        self.say(
            f"\n# ===== {cfg.aiodist_name} {cfg.face} face ({asked}), {cfg.nprocs} ranks on {place['text']}"
            f" (launched by {self.launch.launcher})"
            + (f", beside {' and '.join(beside)} (same processes, alternating)" if beside else "")
            + f" ({cfg.repeat} repetitions, float32, in place) ====="
        )
        if self.mpi_note:
            self.say(self.mpi_note)
        self.collector = JobCollector(
            job,
            cfg.nprocs,
            self.impls,
            in_process=len(self.impls),
            say=self.say,
            step=self.progress.step,
            latency=cfg.latency,
        )

    def take(self, items: Sequence[Any]) -> None:
        if self.collector is None:  # reports before the hosts: none are sent so early
            return
        for item in items:
            self.collector.take(item)


# -- the process ----------------------------------------------------------------------------------


def _watchdog(seconds: float, rank: int) -> None:
    """End this rank when the job outlives ``--timeout``: a rank blocked in a peer's call (MPI
    waits without a bound) must not hang the launch; its launcher then stops the others."""

    def expire() -> None:
        print(
            f"aiodist-bench: rank {rank}: the job did not finish within {seconds:.0f} s (--timeout); stopping",
            file=sys.stderr,
            flush=True,
        )
        os._exit(3)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


def _mpi_transport() -> str:
    chosen = [f"{k[len('OMPI_MCA_') :]}={v}" for k, v in sorted(os.environ.items()) if k in _MCA_SHOWN]
    return "as mpirun chose" + (f" ({', '.join(chosen)})" if chosen else " (Open MPI's defaults)")


_MCA_SHOWN = ("OMPI_MCA_pml", "OMPI_MCA_btl", "OMPI_MCA_btl_tcp_if_include", "OMPI_MCA_osc")


def run_launched(
    args: argparse.Namespace, launch: Launch, cfg: JobConfig, argv: Sequence[str], started: datetime.datetime
) -> int:
    """Run this process's rank of the launched job; rank 0 prints and saves the results.

    Returns the exit status: 0, or 1 when the job failed (rank 0: or any element was wrong).
    """
    rank0 = launch.rank == 0
    _watchdog(cfg.timeout, launch.rank)
    want_mpi = "mpi" in args.compare
    need_rendezvous = launch.is_mpi and not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"))
    session: MpiSession | None = None
    mpi_why: str | None = None
    if want_mpi or need_rendezvous:
        # Before aiodist, torch and their threads: see ``bootstrap``.
        session, mpi_why = start_mpi(launch)
    progress = Progress([cfg], enabled=rank0 and not args.no_progress)
    tables = _Tables(launch, cfg, progress) if rank0 else None
    if tables is not None:
        print(
            f"# aiodist-bench {started:%Y-%m-%d %H:%M %Z}, launched by {launch.launcher}: {launch.world_size} ranks; "
            f"rank 0 on {platform.node()} ({os.cpu_count()} CPUs, Python {platform.python_version()}): sizes {_span(cfg.sizes)}, ops {', '.join(cfg.ops)}",
            flush=True,
        )
        if want_mpi and session is not None:
            tables.with_mpi(session.library, _mpi_transport())
        elif want_mpi:
            tables.without_mpi(mpi_why or "MPI could not start")
    try:
        torch_store, notes = prepare_environment(launch, cfg, session, mpi_why)
    except BenchSetupError as exc:
        print(f"aiodist-bench: rank {launch.rank}: {exc}", file=sys.stderr, flush=True)
        _abort(session)
        return 1
    if tables is not None:
        tables.setup_notes = notes
    worker = LaunchedWorker(
        launch,
        cfg,
        mpi=session if want_mpi else None,
        torch_store=torch_store,
        on_hosts=tables.hosts_known if tables is not None else None,
        collect=tables.take if tables is not None else None,
    )
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    progress.start_job(0)
    error: str | None = None
    t0 = datetime.datetime.now()
    try:
        if cfg.face == "async":
            import uvloop

            uvloop.run(worker.run())
        else:
            asyncio.run(worker.run())
    except (Exception, KeyboardInterrupt) as exc:
        error = f"{exc.__class__.__name__}: {exc}"
        # The bench's own refusals say all there is; anything else shows where it happened.
        where = "" if isinstance(exc, BenchSetupError) else f"\n{traceback.format_exc()}"
        print(f"aiodist-bench: rank {launch.rank} failed: {error}{where}", file=sys.stderr, flush=True)
    finally:
        progress.end_job()
        progress.close()
    if tables is None:
        if error is not None:
            _abort(session)
        return 1 if error else 0
    job = tables.job
    job["seconds"] = (datetime.datetime.now() - t0).total_seconds()
    if error is not None:
        job["error"] = error
        tables.say(f"# job failed: {error}")
    status = _finish(args, launch, job, argv, started)
    if error is not None:
        _abort(session)
    return status


def _span(sizes: Sequence[int]) -> str:
    return f"{report.size_text(sizes[0])} .. {report.size_text(sizes[-1])}" if sizes else "-"


def _abort(session: MpiSession | None) -> None:
    """Take the MPI job down with this rank: the others may wait in an MPI call for it forever."""
    if session is not None:
        session.comm.Abort(1)


def _finish(
    args: argparse.Namespace,
    launch: Launch,
    job: dict[str, Any],
    argv: Sequence[str],
    started: datetime.datetime,
) -> int:
    """Rank 0: the files asked for, the exit status."""
    jobs = [job]
    peers = " and ".join(report.job_impls(job)[1:]) or "nothing"
    where = job.get("placement", f"{launch.world_size} ranks")
    meta = report.run_meta(
        started, argv, f"aiodist vs {peers}, {where}, launched by {launch.launcher}, {started:%Y-%m-%d}"
    )
    meta["launch"] = {
        "launcher": launch.launcher,
        "variables": launch.variables,
        "world_size": launch.world_size,
        "placement": job.get("placement"),
        "hosts": job.get("hosts", []),
    }
    if "mpi" in job:
        meta["mpi"] = dict(job["mpi"])
    elif "mpi_error" in job:
        meta["mpi"] = {"error": job["mpi_error"]}
    data = {"meta": meta, "jobs": jobs}
    report.save(data, json_path=args.json, markdown_path=args.markdown, plot_path=args.plot)
    wrong = report.wrong_elements(jobs)
    if wrong:
        print(f"# {wrong} wrong elements in total", file=sys.stderr)
    return 1 if "error" in job or wrong else 0
