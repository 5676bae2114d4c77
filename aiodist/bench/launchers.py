"""Which launcher started this process as one rank of a job, read from its environment (pure).

``aiodist-bench`` runs in one of two ways: it spawns a job's ranks itself, on this host, or it is
one rank of a job that a launcher started on every node (as nccl-tests runs under ``mpirun``).
The second is recognised by the variables each launcher sets, in the order aiodist's ``env://``
rendezvous reads them:

=======================  ==========================================  ==============================
launcher                 rank, world size                            ranks on this host
=======================  ==========================================  ==============================
aiodist-run, torchrun    RANK, WORLD_SIZE                            LOCAL_RANK, LOCAL_WORLD_SIZE
Open MPI's mpirun        OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE  OMPI_COMM_WORLD_LOCAL_RANK/SIZE
PMI (MPICH's mpiexec)    PMI_RANK, PMI_SIZE                          MPI_LOCALRANKID, MPI_LOCALNRANKS
Slurm's srun             SLURM_PROCID, SLURM_NTASKS                  SLURM_LOCALID, SLURM_STEP_TASKS_PER_NODE
=======================  ==========================================  ==============================
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Launch", "LaunchError", "detect_launch", "tasks_on_node"]


class LaunchError(ValueError):
    """The launcher's variables are present but make no sense (not integers, rank out of range)."""


@dataclass(frozen=True)
class Launch:
    """This process as one rank of a launched job."""

    #: what started it, in words: ``aiodist-run``, ``torchrun``, ``mpirun (Open MPI)``, ...
    launcher: str
    #: ``env`` (RANK/WORLD_SIZE), ``ompi``, ``pmi`` or ``slurm``
    kind: str
    #: the variables that said so, e.g. ``OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE``
    variables: str
    rank: int
    world_size: int
    local_rank: int | None = None
    local_world_size: int | None = None
    #: under torchrun: MASTER_ADDR:MASTER_PORT is torch's own store (the agent's), not a free port
    agent_store: bool = False

    @property
    def is_mpi(self) -> bool:
        """Started by an MPI launcher: the processes may be MPI processes (mpi4py)."""
        return self.kind in ("ompi", "pmi")


_PAIRS = (
    ("env", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("ompi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", ""),
)  # fmt: skip


def _int(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"environment variable {name}={value!r} is not an integer") from None


def _optional_int(environ: Mapping[str, str], name: str) -> int | None:
    return _int(environ, name) if name and environ.get(name, "").strip() else None


def _launcher_name(kind: str, environ: Mapping[str, str]) -> str:
    if kind == "ompi":
        return "mpirun (Open MPI)"
    if kind == "pmi":
        return "mpiexec (PMI)"
    if kind == "slurm":
        return "srun (Slurm)"
    if "AIODIST_RESTART_COUNT" in environ:
        return "aiodist-run"
    if "TORCHELASTIC_RUN_ID" in environ:
        return "torchrun"
    return "a launcher (RANK/WORLD_SIZE)"


def tasks_on_node(spec: str, node_id: int) -> int | None:
    """Slurm's tasks-per-node list (``2(x3),1``: 2 on each of the first 3 nodes, 1 on the 4th) at
    node ``node_id``; None when the list does not say."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node_id] if 0 <= node_id < len(counts) else None


def detect_launch(environ: Mapping[str, str]) -> Launch | None:
    """The launch this environment describes, or None when no launcher started this process.

    Raises:
        LaunchError: a launcher's variables are set but are not integers, or the rank is not
            below the world size.
    """
    for kind, rank_var, size_var, local_rank_var, local_size_var in _PAIRS:
        if rank_var not in environ or size_var not in environ:
            continue
        rank, size = _int(environ, rank_var), _int(environ, size_var)
        if size < 1 or not 0 <= rank < size:
            raise LaunchError(
                f"{rank_var}={rank} with {size_var}={size}: the rank must be in 0..{size_var}-1"
            )
        local_size = _optional_int(environ, local_size_var)
        if kind == "slurm" and "SLURM_STEP_TASKS_PER_NODE" in environ and "SLURM_NODEID" in environ:
            local_size = tasks_on_node(environ["SLURM_STEP_TASKS_PER_NODE"], _int(environ, "SLURM_NODEID"))
        launcher = _launcher_name(kind, environ)
        return Launch(
            launcher=launcher,
            kind=kind,
            variables=f"{rank_var}/{size_var}",
            rank=rank,
            world_size=size,
            local_rank=_optional_int(environ, local_rank_var),
            local_world_size=local_size,
            agent_store=launcher == "torchrun"
            and environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
        )
    return None
