"""The entry point shared by ``aiodist.run`` and ``aiodist.launch``: parse, announce, supervise."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence

from aiodist._launcher.config import parse_config
from aiodist._launcher.env import omp_threads_notice, resolve_secret
from aiodist._launcher.supervisor import Supervisor

__all__ = ["launcher_main"]


def launcher_main(argv: Sequence[str] | None, *, prog: str, legacy: bool) -> int:
    """Runs a launcher command line to completion and returns the process exit code.

    Returns:
        0 when every worker exited 0; 1 when the worker group failed and no restart was left;
        2 on a bad command line; 128 + signum when the launcher was stopped by a signal.
    """
    try:
        config = parse_config(argv, prog=prog, legacy=legacy)
    except SystemExit as exc:  # argparse's --help and usage errors; main() returns, never exits
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    secret, secret_warning = resolve_secret(os.environ, config.nnodes)
    supervisor = Supervisor(
        config,
        prog=prog,
        secret=secret,
        environ=os.environ,
        stdout=sys.stdout.buffer,
        stderr=sys.stderr.buffer,
    )
    for warning in (*config.notices, secret_warning):
        if warning is not None:
            supervisor.notice(f"warning: {warning}")
    omp_notice = omp_threads_notice(os.environ, config.nproc_per_node)
    if omp_notice is not None:
        supervisor.notice(omp_notice)
    try:
        return asyncio.run(supervisor.run())
    except KeyboardInterrupt:  # a SIGINT before the supervisor's handlers were installed
        return 130
