"""What a launched rank needs before aiodist's rendezvous: MPI (first, where it is measured or
needed), then MASTER_ADDR/MASTER_PORT/AIODIST_SECRET where the launcher gave none, and a store
for torch's gloo group on the network.

- **MPI first.** Under ``mpirun`` the bench's processes are MPI processes: mpi4py initialises
  MPI (``MPI_Init_thread``, funneled: the bench calls MPI from its main thread only; the sync
  face's loop thread and the memory sampler never do) before aiodist starts its loop, its
  threads and its sockets, and before torch, so that MPI sets itself up in a process that is
  still plain. It is finalised at exit. mpi4py must be built on the MPI library whose launcher
  started the processes (Open MPI's ``mpirun``: Open MPI); the bench checks the library before
  it initialises it and ``MPI_COMM_WORLD``'s size after.
- **The rendezvous under mpirun** (which sets no MASTER_ADDR/MASTER_PORT): as nccl-tests sends
  NCCL's unique id, rank 0 sends what is missing over MPI: an address of its host that every
  other rank's host shares a network with (127.0.0.1 when all share its network stack), a free
  port, and a fresh ``AIODIST_SECRET``.
- **Under torchrun**, MASTER_ADDR:MASTER_PORT is torch's own store (the agent's): aiodist's
  rendezvous joins it as a client, and gloo meets there too, under a prefix of its own.
- **gloo** elsewhere: rank 0 hosts a torch ``TCPStore`` on a free port of every interface and
  sends its port to the others over aiodist (``broadcast_object_list``) once aiodist is up.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiodist.bench import hosts
from aiodist.bench.hosts import choose_master_address, ipv4_networks, network_identity
from aiodist.bench.launchers import Launch
from aiodist.bench.worker import JobConfig, ask_transport

__all__ = [
    "BenchSetupError",
    "MpiSession",
    "free_port_anywhere",
    "mpi_rendezvous",
    "prepare_environment",
    "start_mpi",
    "torchrun_rendezvous",
]


class BenchSetupError(RuntimeError):
    """A launched rank cannot take part in the job; the message says why and what to do."""


@dataclass
class MpiSession:
    """MPI, initialised in this process by mpi4py."""

    comm: Any  # MPI.COMM_WORLD
    MPI: Any  # the mpi4py.MPI module
    library: str  # e.g. "Open MPI v5.0.11"


def free_port_anywhere() -> int:
    """A TCP port that was free on every interface of this machine a moment ago."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _library(mpi: Any) -> str:
    first = str(mpi.Get_library_version()).strip().splitlines()[0]
    return first.split(",")[0].strip()


def start_mpi(launch: Launch) -> tuple[MpiSession | None, str | None]:
    """Initialise MPI in this process: ``(session, None)``, or ``(None, why it cannot run here)``.

    Every rank reaches the same answer (the checks depend on the installation and the launch,
    not on the rank), so either all ranks take part in MPI or none does.
    """
    if not launch.is_mpi:
        return None, (
            f"the ranks were started by {launch.launcher}, not by mpirun/mpiexec, so they are not MPI "
            "processes (launch the bench with mpirun to measure MPI beside aiodist)"
        )
    if importlib.util.find_spec("mpi4py") is None:
        return None, "mpi4py is not installed (pip install 'aiodist[bench]')"
    import mpi4py

    # Initialised here, explicitly, after the library is checked; finalised at exit.
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = True
    mpi4py.rc.thread_level = "funneled"
    from mpi4py import MPI

    library = _library(MPI)
    if launch.kind == "ompi" and "Open MPI" not in library:
        return None, f"mpi4py is built on {library}, but Open MPI's mpirun started the ranks"
    if launch.kind == "pmi" and "Open MPI" in library:
        return (
            None,
            f"mpi4py is built on {library}, but a PMI launcher (not Open MPI's mpirun) started the ranks",
        )
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_FUNNELED)
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    if (size, rank) != (launch.world_size, launch.rank):
        return None, (
            f"MPI_COMM_WORLD has {size} ranks and calls this one {rank}, but {launch.variables} say "
            f"{launch.rank} of {launch.world_size}: mpi4py's MPI library is not the launcher's"
        )
    return MpiSession(comm, MPI, library), None


def mpi_rendezvous(session: MpiSession, environ: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """What rank 0 decides, over MPI, for the variables the launcher left unset.

    Returns the variables to set (MASTER_ADDR, MASTER_PORT, AIODIST_SECRET, where unset) and
    lines that say where each came from.

    Raises:
        BenchSetupError: rank 0 found no address every host can reach (on every rank).
    """
    comm = session.comm
    facts = comm.allgather((network_identity(), ipv4_networks()))
    decision: tuple[dict[str, str], list[str]] | str | None = None
    if comm.Get_rank() == 0:
        env: dict[str, str] = {}
        notes: list[str] = []
        try:
            if not environ.get("MASTER_ADDR"):
                env["MASTER_ADDR"] = choose_master_address(
                    facts[0][1], [f[0] for f in facts], [f[1] for f in facts[1:]]
                )
                notes.append(f"MASTER_ADDR={env['MASTER_ADDR']}: chosen by rank 0, sent over MPI")
            if not environ.get("MASTER_PORT"):
                env["MASTER_PORT"] = str(free_port_anywhere())
                notes.append(f"MASTER_PORT={env['MASTER_PORT']}: a free port of rank 0's, sent over MPI")
            if not environ.get("AIODIST_SECRET"):
                env["AIODIST_SECRET"] = secrets.token_hex(32)
                notes.append("AIODIST_SECRET: generated by rank 0, sent over MPI")
            decision = (env, notes)
        except ValueError as exc:
            decision = str(exc)
    decision = comm.bcast(decision, root=0)
    if isinstance(decision, str):
        raise BenchSetupError(decision)
    assert decision is not None
    return decision


def torchrun_rendezvous(launch: Launch, environ: Mapping[str, str], timeout: float) -> Any:
    """Under torchrun: torchrun's store (its agent's, at MASTER_ADDR:MASTER_PORT), for gloo, under
    a prefix of this restart attempt's (aiodist's own rendezvous joins the same store itself)."""
    from torch._C._distributed_c10d import PrefixStore, TCPStore

    store = TCPStore(
        environ["MASTER_ADDR"],
        int(environ["MASTER_PORT"]),
        None,
        False,
        timeout=datetime.timedelta(seconds=timeout),
    )
    return PrefixStore(f"aiodist-bench/gloo/{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def prepare_environment(
    launch: Launch, cfg: JobConfig, session: MpiSession | None, mpi_why: str | None
) -> tuple[Any, list[str]]:
    """Set this process's environment for its rank of the job, before aiodist starts.

    Returns a torch store for gloo (torchrun's) or None, and lines that say where the
    rendezvous and gloo's interface came from.

    Raises:
        BenchSetupError: the rendezvous address is unknown, or gloo's interface cannot be found.
    """
    notes: list[str] = []
    if session is not None:
        env, notes = mpi_rendezvous(session, os.environ)
        os.environ.update(env)
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if missing:
        how = (
            f" (mpirun: install mpi4py, and rank 0 sends them over MPI; here: {mpi_why})"
            if launch.is_mpi
            else ""
        )
        raise BenchSetupError(
            f"{launch.launcher} set no {' or '.join(missing)}: export MASTER_ADDR=<an address of rank 0's host> "
            f"MASTER_PORT=<a free port> for every rank{how}"
        )
    torch_store = None
    if launch.agent_store:
        torch_store = torchrun_rendezvous(launch, os.environ, max(60.0, cfg.timeout))
        notes.append("aiodist and gloo meet at torchrun's store (MASTER_ADDR:MASTER_PORT, its agent's)")
    os.environ["RANK"] = str(launch.rank)
    os.environ["WORLD_SIZE"] = str(launch.world_size)
    if launch.local_world_size is not None:
        # aiodist sizes its busy polling by the ranks sharing this host's cores.
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(launch.local_world_size))
    ask_transport(cfg.transport, os.environ)  # (whatever the caller's environment says, as spawned)
    if cfg.compare:
        try:
            ifname, how = hosts.gloo_interface(os.environ["MASTER_ADDR"], os.environ)
        except ValueError as exc:
            raise BenchSetupError(str(exc)) from None
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
        notes.append(f"gloo on rank 0: GLOO_SOCKET_IFNAME={ifname} ({how})")
    return torch_store, notes
