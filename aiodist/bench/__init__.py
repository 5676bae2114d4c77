"""``aiodist-bench``: nccl-tests style tables for every operation, both faces, beside gloo and MPI.

The package: ``cli`` (arguments, the jobs, the tables), ``cases`` (what is measured),
``worker`` (one rank of a job), ``mpi`` (the MPI peer: launching ``mpiexec``, collecting its
figures), ``mpi_worker`` (one MPI rank), ``progress`` (the live line), ``report`` (tables,
targets, JSON, markdown, the plot).
"""

from aiodist.bench.cli import main, parse_size, run_job

__all__ = ["main", "parse_size", "run_job"]
