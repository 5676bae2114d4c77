"""``aiodist-bench``: nccl-tests style tables for every operation, both faces, beside gloo and MPI.

The package: ``cli`` (arguments, the spawned jobs), ``cases`` (what is measured), ``worker``
(one rank of a job), ``collect`` (the ranks' reports into rows), ``mpi`` (the MPI peer of a
spawned run: launching ``mpiexec``, collecting its figures), ``mpi_worker`` (one MPI rank),
``launched`` (one rank of a job a launcher started, on many hosts), ``launchers`` (which
launcher, from the environment), ``bootstrap`` (MPI first, the rendezvous, gloo's store),
``hosts`` (where the ranks ran), ``progress`` (the live line), ``report`` (tables, JSON,
markdown, the plot).
"""

from aiodist.bench.cli import main, parse_size, run_job

__all__ = ["main", "parse_size", "run_job"]
