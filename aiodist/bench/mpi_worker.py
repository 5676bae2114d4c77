"""One rank of the MPI peer: the bench's cases through mpi4py, run by ``mpiexec``.

``python -m aiodist.bench.mpi_worker CONFIG RESULTS``: ``CONFIG`` is a JSON file of the job's
``JobConfig``; every rank appends its results to ``RESULTS`` as JSON lines, the same items a
``worker`` rank puts on its queue. The cases, their buffers, the checked call, the warm-up and
the timing are ``worker.Worker``'s own, so MPI's figures are measured exactly as aiodist's
and gloo's: the only difference is the runtime bound to each case (``MpiRuntime``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback
import warnings
from collections.abc import Sequence
from typing import Any

from aiodist.bench.cases import Buffers
from aiodist.bench.worker import STREAM_BURST, Call, JobConfig, Runtime, Worker

__all__ = ["MpiRuntime", "main"]


def _idle() -> None:
    return None


class MpiRuntime(Runtime):
    """mpi4py's buffer interface (``Allreduce``, ``Bcast``, ...) on the numpy arrays: blocking calls."""

    name = "mpi"

    def __init__(self, comm: Any, mpi: Any) -> None:
        self.comm = comm
        self.MPI = mpi

    def barrier(self) -> Any:
        self.comm.Barrier()

    def bind(self, op: str, bufs: Buffers, rank: int, n: int) -> Call:
        c, mpi, a, b = self.comm, self.MPI, bufs.a, bufs.b
        peer = rank ^ 1
        if op == "all_reduce":
            return lambda: c.Allreduce(mpi.IN_PLACE, a, op=mpi.SUM)
        if op == "broadcast":
            return lambda: c.Bcast(a, root=0)
        if op == "reduce":
            if rank == 0:
                return lambda: c.Reduce(mpi.IN_PLACE, a, op=mpi.SUM, root=0)
            return lambda: c.Reduce(a, None, op=mpi.SUM, root=0)
        if op == "all_gather":
            return lambda: c.Allgather(a, b)
        if op == "reduce_scatter":
            return lambda: c.Reduce_scatter_block(a, b, op=mpi.SUM)
        if op == "all_to_all":
            return lambda: c.Alltoall(a, b)
        if op == "gather":
            return lambda: c.Gather(a, b if rank == 0 else None, root=0)
        if op == "scatter":
            return lambda: c.Scatter(a if rank == 0 else None, b, root=0)
        if op == "sendrecv":
            right, left = (rank + 1) % n, (rank - 1) % n
            return lambda: c.Sendrecv(a, right, recvbuf=b, source=left)
        if op == "barrier":
            return lambda: c.Barrier()
        if op == "pingpong":
            if peer >= n:
                return _idle
            if rank % 2 == 0:

                def ping() -> None:
                    c.Send(a, peer)
                    c.Recv(a, peer)

                return ping

            def pong() -> None:
                c.Recv(a, peer)
                c.Send(a, peer)

            return pong
        if op == "stream":
            if peer >= n:
                return _idle
            start = c.Isend if rank % 2 == 0 else c.Irecv
            return lambda: mpi.Request.Waitall([start(a, peer) for _ in range(STREAM_BURST)])
        raise ValueError(op)


class _Lines:
    """A results file shared by the ranks: one ``write`` per line, appended (O_APPEND keeps
    lines of different ranks whole)."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def put(self, item: Sequence[Any]) -> None:
        os.write(self.fd, (json.dumps(list(item)) + "\n").encode())


class MpiWorker(Worker):
    def __init__(self, rank: int, cfg: JobConfig, out: Any, comm: Any, mpi: Any) -> None:
        super().__init__(rank, cfg, out)
        self.comm = comm
        self.MPI = mpi

    async def setup(self) -> None:
        self.runtimes.append(MpiRuntime(self.comm, self.MPI))

    async def teardown(self) -> None:
        self.comm.Barrier()


def _library(mpi: Any) -> str:
    """The MPI library's name and version, e.g. ``Open MPI v5.0.11``."""
    first = str(mpi.Get_library_version()).strip().splitlines()[0]
    return first.split(",")[0].strip()


def main(argv: Sequence[str] | None = None) -> int:
    config_path, results_path = (sys.argv[1:] if argv is None else list(argv))[:2]
    with open(config_path) as f:
        raw = json.load(f)
    raw["ops"], raw["sizes"] = tuple(raw["ops"]), tuple(raw["sizes"])
    cfg = JobConfig(**raw)
    out = _Lines(results_path)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    import mpi4py

    # The cases call MPI from the main thread only (the RSS sampler's thread never does).
    mpi4py.rc.thread_level = "funneled"
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size != cfg.nprocs:
        out.put(("error", rank, f"mpiexec started {size} ranks, the job asked for {cfg.nprocs}"))
        return 1
    try:
        out.put(("library", rank, _library(MPI)))
        asyncio.run(MpiWorker(rank, cfg, out, comm, MPI).run())
    except BaseException as exc:
        out.put(("error", rank, f"{exc.__class__.__name__}: {exc}\n{traceback.format_exc()}"))
        comm.Abort(1)
        return 1
    out.put(("done", rank))
    return 0


if __name__ == "__main__":
    sys.exit(main())
