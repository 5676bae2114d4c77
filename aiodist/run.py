"""``aiodist-run`` / ``python -m aiodist.run``: the torchrun-style launcher.

Starts ``--nproc-per-node`` workers on this node, gives each the torch.distributed environment
(MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK, ... and AIODIST_SECRET; the full contract is in
:mod:`aiodist._launcher.env`), relays their output prefixed ``[rank N]: ``, stops them all when one
fails and restarts the group up to ``--max-restarts`` times. The launcher starts no store: the
rank-0 worker's ``init_process_group`` hosts it at MASTER_ADDR:MASTER_PORT (static rendezvous;
torchrun's ``--rdzv-backend c10d --rdzv-endpoint HOST:PORT`` is another spelling of that address).
Every torchrun flag is honoured or refused with its reason (:mod:`aiodist._launcher.config`); a
script, module or executable that does not exist is refused before any worker starts.

Secret policy: an ``AIODIST_SECRET`` already set is passed on; otherwise a single-node run
generates a random one shared by all workers and restarts; a multi-node run generates none (the
nodes could not agree on it) and warns that every node needs the same ``AIODIST_SECRET``.

Logs: with ``--log-dir D``, ``D/<run-id>/attempt_<k>/<local_rank>/{stdout,stderr}.log`` (run id from
``--run-id``/``--rdzv-id``, else a timestamp); ``--tee``/``--redirects`` choose the streams (torchrun's
0-3 masks), and without ``--log-dir`` they log to a temporary directory that is announced.

Exit codes: 0 all workers succeeded; 1 the group failed with no restart left (a summary on stderr
names the root-cause rank, its pid, exit code or signal, error and stderr tail, and says of every
other worker whether it failed on its own or was stopped by the launcher; see
:mod:`aiodist._launcher.summary`); 2 bad command line; 128 + signum when the launcher got one of
``--signals-to-handle`` (SIGINT/SIGTERM/SIGHUP/SIGQUIT; forwarded to the workers, SIGKILL after
``--term-timeout``/``$AIODIST_TERM_TIMEOUT`` seconds, default 5).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from aiodist._launcher.cli import launcher_main

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the launcher on ``argv`` (default ``sys.argv[1:]``) and returns its exit code."""
    return launcher_main(argv, prog="aiodist.run", legacy=False)


if __name__ == "__main__":
    sys.exit(main())
