"""``aiodist-bench``: nccl-tests style tables for every operation, both faces, beside gloo.

The package: ``cli`` (arguments, the jobs, the tables), ``cases`` (what is measured),
``worker`` (one rank of a job), ``progress`` (the live line), ``report`` (tables, JSON, markdown).
"""

from aiodist.bench.cli import main, parse_size, run_job

__all__ = ["main", "parse_size", "run_job"]
