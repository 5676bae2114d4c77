"""One rank of a benchmark job: aiodist (one face) and, with ``compare``, torch's gloo, side by side.

(The MPI peer runs the same ``Worker`` in processes of its own, under ``mpiexec``: see
``aiodist.bench.mpi_worker``; a launched job's ranks run it with MPI beside aiodist and gloo:
see ``aiodist.bench.launched``.)

Both runtimes live in the same process, each with its own connections. For every case the
same buffers serve both (torch tensors are views of the numpy arrays), each runtime first
makes one checked call (``#wrong``), then the timed repetitions alternate between them
(aiodist first on even repetitions, gloo first on odd ones), each preceded by that
runtime's own barrier. A repetition times ``iters`` back-to-back blocking (or awaited)
calls; the parent takes the slowest rank of each repetition and the median over them.

Results go to the parent through a multiprocessing queue as plain tuples (in a launched job,
to rank 0 through aiodist itself).
"""

from __future__ import annotations

import asyncio
import datetime
import gc
import os
import threading
import time
import warnings
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np

import aiodist.native as native
from aiodist.bench import cases
from aiodist.bench.cases import Buffers

__all__ = [
    "AIODIST_NAMES",
    "ASKED_WORDS",
    "ask_transport",
    "JobConfig",
    "Runtime",
    "Worker",
    "have_torch",
    "iterations",
    "join_aiodist",
    "worker_main",
]

STREAM_BURST = 100  # messages per repetition of the "stream" case


@dataclass(frozen=True)
class JobConfig:
    """What one job (one face, one world size) measures."""

    face: str  # "async" | "sync"
    nprocs: int
    ops: tuple[str, ...]
    sizes: tuple[int, ...]
    compare: bool  # torch's gloo in the same processes, alternating with aiodist
    repeat: int = 5
    iters: int = 0  # 0: by size (``iterations``)
    warmup: int = 0  # 0: by size
    latency: bool = True
    memory_bytes: int = 0  # the memory probe's all_reduce size; 0: no probe
    gloo_port: int = 0
    timeout: float = 600.0
    #: what aiodist is asked to use between ranks of one host: "shm" (its default: shared memory
    #: where the transport offers it; ``AIODIST_SHM`` unset), "tcp" (``AIODIST_SHM=0``) or
    #: "python" (shared memory on the Python engine: ``AIODIST_NATIVE=0``). See ``ASKED``.
    transport: str = "shm"
    #: "aiodist" (this module's worker) or "mpi" (the MPI peer, under mpiexec).
    runtime: str = "aiodist"

    @property
    def aiodist_name(self) -> str:
        """aiodist's column name in this job's tables."""
        return AIODIST_NAMES[self.transport]

    @property
    def label(self) -> str:
        """The job in a few words: ``async 2 ranks``, ``sync tcp 4 ranks``, ``mpi 2 ranks``."""
        if self.runtime == "mpi":
            return f"mpi {self.nprocs} ranks"
        transport = "" if self.transport == "shm" else f" {self.transport}"
        return f"{self.face}{transport} {self.nprocs} ranks"


#: aiodist's name in the tables, by the transport it is asked to use.
AIODIST_NAMES = {"shm": "aiodist", "tcp": "aiodist-tcp", "python": "aiodist-py"}
#: How each is asked for: the variables set (None: removed) whatever the caller's environment says.
ASKED: dict[str, dict[str, str | None]] = {
    "shm": {"AIODIST_SHM": None, "AIODIST_NATIVE": None},
    "tcp": {"AIODIST_SHM": "0", "AIODIST_NATIVE": None},
    "python": {"AIODIST_SHM": None, "AIODIST_NATIVE": "0"},
}
#: The same in words, for the job's notes.
ASKED_WORDS = {
    "shm": "its default transport",
    "tcp": "TCP only (AIODIST_SHM=0)",
    "python": "its default transport on the Python engine (AIODIST_NATIVE=0)",
}


def ask_transport(transport: str, environ: MutableMapping[str, str]) -> None:
    """Set ``environ`` as ``ASKED[transport]`` says."""
    for name, value in ASKED[transport].items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value


def iterations(nbytes: int, cfg: JobConfig) -> tuple[int, int]:
    """(warm-up calls, timed calls per repetition) for a case of ``nbytes``."""
    if cfg.iters:
        return (cfg.warmup or 2), cfg.iters
    # Many short repetitions rather than a few long ones: load on a shared machine comes in
    # bursts, and the alternation only compares like with like when bursts are shorter.
    iters = max(2, min(24, (64 << 20) // max(1, nbytes)))
    warm = cfg.warmup or (1 if nbytes >= (16 << 20) else 2 if nbytes >= (1 << 20) else 5)
    return warm, iters


# -- the runtimes under test ---------------------------------------------------------------------

Call = Callable[[], Any]


def _timed(fn: Call, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return time.perf_counter() - t0


class Runtime:
    """One implementation: binds an operation on a set of buffers to a zero-argument call."""

    name = ""
    awaits = False  # calls return awaitables (the async face)

    def bind(self, op: str, bufs: Buffers, rank: int, n: int) -> Call:
        raise NotImplementedError

    def barrier(self) -> Any:
        raise NotImplementedError

    async def run(self, fn: Call, iters: int) -> float:
        """Seconds taken by ``iters`` calls of ``fn`` in a row."""
        if self.awaits:
            t0 = time.perf_counter()
            for _ in range(iters):
                await fn()
            return time.perf_counter() - t0
        return _timed(fn, iters)

    async def sync(self) -> None:
        r = self.barrier()
        if self.awaits:
            await r


async def _both(a: Awaitable[Any], b: Awaitable[Any]) -> None:
    await a
    await b


async def _all(works: list[Any]) -> None:
    for w in works:
        await w


class AsyncAiodist(Runtime):
    """``import aiodist as dist``: numpy arrays, every call awaited."""

    name = "aiodist"
    awaits = True

    def __init__(self, name: str = "aiodist") -> None:
        import aiodist

        self.name = name
        self.d = aiodist

    def barrier(self) -> Any:
        return self.d.barrier()

    def bind(self, op: str, bufs: Buffers, rank: int, n: int) -> Call:
        d, a, b = self.d, bufs.a, bufs.b
        peer = rank ^ 1
        if op == "all_reduce":
            return lambda: d.all_reduce(a)
        if op == "broadcast":
            return lambda: d.broadcast(a, 0)
        if op == "reduce":
            return lambda: d.reduce(a, 0)
        if op == "all_gather":
            return lambda: d.all_gather_into_tensor(b, a)
        if op == "reduce_scatter":
            return lambda: d.reduce_scatter_tensor(b, a)
        if op == "all_to_all":
            return lambda: d.all_to_all_single(b, a)
        if op == "gather":
            gl = bufs.blocks_b if rank == 0 else None
            return lambda: d.gather(a, gl, 0)
        if op == "scatter":
            sl = bufs.blocks_a if rank == 0 else None
            return lambda: d.scatter(b, sl, 0)
        if op == "sendrecv":
            right, left = (rank + 1) % n, (rank - 1) % n
            return lambda: _both(d.send(a, right), d.recv(b, left))
        if op == "barrier":
            return lambda: d.barrier()
        if op == "pingpong":
            if peer >= n:
                return _idle
            if rank % 2 == 0:
                return lambda: _both(d.send(a, peer), d.recv(a, peer))
            return lambda: _recv_then_send(d, a, peer)
        if op == "stream":
            if peer >= n:
                return _idle
            if rank % 2 == 0:
                return lambda: _all([d.send(a, peer) for _ in range(STREAM_BURST)])
            return lambda: _all([d.recv(a, peer) for _ in range(STREAM_BURST)])
        raise ValueError(op)


async def _recv_then_send(d: Any, a: Any, peer: int) -> None:
    await d.recv(a, peer)
    await d.send(a, peer)


async def _idle() -> None:
    return None


def _idle_sync() -> None:
    return None


class BlockingTorchLike(Runtime):
    """The torch.distributed calling convention: ``aiodist.sync`` or ``torch.distributed`` (gloo)."""

    def __init__(self, name: str, module: Any, use_torch: bool) -> None:
        self.name = name
        self.d = module
        self.use_torch = use_torch

    def _t(self, arr: np.ndarray[Any, Any] | None) -> Any:
        if arr is None or not self.use_torch:
            return arr
        import torch

        return torch.from_numpy(arr)

    def barrier(self) -> Any:
        return self.d.barrier()

    async def run(self, fn: Call, iters: int) -> float:
        # Timed from a thread that runs no event loop, as a program calls a blocking face (this
        # worker's own loop runs on its main thread): aiodist's blocking collectives run on
        # their caller's thread only where no loop runs there.
        return await asyncio.to_thread(_timed, fn, iters)

    def bind(self, op: str, bufs: Buffers, rank: int, n: int) -> Call:
        d = self.d
        a, b = self._t(bufs.a), self._t(bufs.b)
        peer = rank ^ 1
        if op == "all_reduce":
            return lambda: d.all_reduce(a)
        if op == "broadcast":
            return lambda: d.broadcast(a, 0)
        if op == "reduce":
            return lambda: d.reduce(a, 0)
        if op == "all_gather":
            ag = getattr(d, "all_gather_single", None) or d.all_gather_into_tensor
            return lambda: ag(b, a)
        if op == "reduce_scatter":
            rs = getattr(d, "reduce_scatter_single", None) or d.reduce_scatter_tensor
            return lambda: rs(b, a)
        if op == "all_to_all":
            return lambda: d.all_to_all_single(b, a)
        if op == "gather":
            gl = [self._t(x) for x in bufs.blocks_b] if rank == 0 else None
            return lambda: d.gather(a, gl, 0)
        if op == "scatter":
            sl = [self._t(x) for x in bufs.blocks_a] if rank == 0 else None
            return lambda: d.scatter(b, sl, 0)
        if op == "sendrecv":
            right, left = (rank + 1) % n, (rank - 1) % n

            def sendrecv() -> None:
                ws = d.isend(a, right)
                wr = d.irecv(b, left)
                ws.wait()
                wr.wait()

            return sendrecv
        if op == "barrier":
            return lambda: d.barrier()
        if op == "pingpong":
            if peer >= n:
                return _idle_sync
            if rank % 2 == 0:

                def ping() -> None:
                    d.send(a, peer)
                    d.recv(a, peer)

                return ping

            def pong() -> None:
                d.recv(a, peer)
                d.send(a, peer)

            return pong
        if op == "stream":
            if peer >= n:
                return _idle_sync
            start = d.isend if rank % 2 == 0 else d.irecv

            def stream() -> None:
                works = [start(a, peer) for _ in range(STREAM_BURST)]
                for w in works:
                    w.wait()

            return stream
        raise ValueError(op)


# -- memory --------------------------------------------------------------------------------------


def rss_bytes() -> int:
    """This process's resident set size now (Linux ``/proc``; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _RssSampler:
    """Samples RSS every half millisecond in a thread; ``peak`` is the highest seen."""

    def __init__(self) -> None:
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.0005)

    def __enter__(self) -> _RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


# -- the job -------------------------------------------------------------------------------------


async def join_aiodist(cfg: JobConfig, timeout: float) -> Runtime:
    """Join the job's aiodist group (env://) on ``cfg``'s face; the runtime that measures it."""
    if cfg.face == "async":
        import aiodist

        await aiodist.init_process_group("tcp", "env://", timeout=timeout)
        return AsyncAiodist(cfg.aiodist_name)
    import aiodist.sync as sd

    # The bench never uses torch's helpers, and its gloo comparison needs torch's default group
    # for gloo: a launched rank joins aiodist first (gloo's store port travels over aiodist), so
    # torch's slot would be taken when gloo's init_process_group comes.
    sd.init_process_group(
        "gloo", "env://", timeout=datetime.timedelta(seconds=timeout), torch_default_group="0"
    )
    return BlockingTorchLike(cfg.aiodist_name, sd, use_torch=have_torch())


class Worker:
    def __init__(self, rank: int, cfg: JobConfig, out: Any) -> None:
        self.rank = rank
        self.n = cfg.nprocs
        self.cfg = cfg
        self.out = out
        self.runtimes: list[Runtime] = []

    def emit(self, *item: Any) -> None:
        self.out.put(item)

    async def setup(self) -> None:
        cfg = self.cfg
        timeout = max(60.0, cfg.timeout)
        if cfg.compare:
            import torch.distributed as td

            td.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{cfg.gloo_port}",
                rank=self.rank,
                world_size=self.n,
                timeout=datetime.timedelta(seconds=timeout),
            )
        self.runtimes.append(await join_aiodist(cfg, timeout))
        if cfg.compare:
            import torch.distributed as td

            self.runtimes.append(BlockingTorchLike("gloo", td, use_torch=True))

    async def teardown(self) -> None:
        for rt in self.runtimes:
            await rt.sync()
        if self.cfg.face == "async":
            import aiodist

            await aiodist.destroy_process_group()
        else:
            import aiodist.sync as sd

            sd.destroy_process_group()
        if self.cfg.compare:
            import torch.distributed as td

            td.destroy_process_group()

    async def call_once(self, rt: Runtime, fn: Call) -> None:
        r = fn()
        if rt.awaits:
            await r

    async def memory(self) -> None:
        """RSS added by a large all_reduce, per runtime (the buffer itself allocated before)."""
        count = self.cfg.memory_bytes // 4
        bufs = cases.make_buffers("all_reduce", count, self.rank, self.n)
        for rt in self.runtimes:
            fn = rt.bind("all_reduce", bufs, self.rank, self.n)
            small = rt.bind(
                "all_reduce", cases.make_buffers("all_reduce", 1, self.rank, self.n), self.rank, self.n
            )
            await self.call_once(rt, small)
            await rt.sync()
            gc.collect()
            cases.fill("all_reduce", bufs, self.rank, self.n)
            before = rss_bytes()
            with _RssSampler() as sampler:
                for _ in range(2):
                    await self.call_once(rt, fn)
            self.emit("memory", self.rank, rt.name, self.cfg.memory_bytes, sampler.peak - before)
        del bufs

    async def case(self, op: str, nbytes: int, *, latency: bool = False) -> None:
        n, rank = self.n, self.rank
        count = cases.count_for(op, nbytes, n) if nbytes else 0
        bufs = cases.make_buffers(op, count, rank, n)
        warm, iters = iterations(max(nbytes, 1), self.cfg)
        reps = self.cfg.repeat
        if latency:
            # Short calls, so more alternations (load on a shared machine comes in bursts).
            iters = 40 if op != "stream" else 6
            reps = max(7, reps + 2)
        fns: dict[str, Call] = {}
        wrong: dict[str, int] = {}
        for rt in self.runtimes:
            fn = fns[rt.name] = rt.bind(op, bufs, rank, n)
            if not latency:
                cases.fill(op, bufs, rank, n)
                await rt.sync()
                await self.call_once(rt, fn)
                wrong[rt.name] = cases.check(op, bufs, rank, n)
            await rt.sync()
            for _ in range(warm):
                await self.call_once(rt, fn)
        times: dict[str, list[float]] = {rt.name: [] for rt in self.runtimes}
        for rep in range(reps):
            order = self.runtimes if rep % 2 == 0 else self.runtimes[::-1]
            for rt in order:
                await rt.sync()
                dt = await rt.run(fns[rt.name], iters)
                times[rt.name].append(dt / iters)
        kind = "latency" if latency else "case"
        self.emit(kind, rank, op, nbytes, count, {k: (v, wrong.get(k, 0)) for k, v in times.items()})

    async def report(self) -> None:
        """Called after each step (the memory probe, every case): a launched job's ranks send
        what they emitted to rank 0 here; a spawned job's are on their queue already."""

    async def run(self) -> None:
        await self.setup()
        self.emit("ready", self.rank)
        if self.cfg.memory_bytes:
            await self.memory()
            await self.report()
        if self.cfg.latency:
            for op, nbytes in cases.LATENCY:
                await self.case(op, nbytes, latency=True)
                await self.report()
        for op in self.cfg.ops:
            for nbytes in self.cfg.sizes:
                await self.case(op, nbytes)
                await self.report()
        await self.teardown()


def have_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def worker_main(rank: int, cfg: JobConfig, env: dict[str, str], out: Any) -> None:
    """Entry point of one rank (a spawned process)."""
    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(cfg.nprocs)
    ask_transport(cfg.transport, os.environ)  # (whatever the caller's environment says)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    w = Worker(rank, cfg, out)
    try:
        if cfg.face == "async":
            import uvloop

            uvloop.run(w.run())
        else:
            asyncio.run(w.run())
    except BaseException as exc:
        import traceback

        out.put(("error", rank, f"{exc.__class__.__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None
    out.put(("done", rank, native.describe()))  # (which engine ran each compiled part's work)
