"""``python -m aiodist.launch``: the legacy launcher, like ``torch.distributed.launch``.

Same flags and behaviour as :mod:`aiodist.run`, with one difference kept for old scripts: each
worker gets ``--local_rank=N`` right after the script (or module) name, before its own
arguments, unless ``--use-env``/``--use_env`` is given (then it reads ``LOCAL_RANK``, as under
``aiodist.run``). The environment contract, log layout and exit codes are those of :mod:`aiodist.run`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from aiodist._launcher.cli import launcher_main

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the legacy launcher on ``argv`` (default ``sys.argv[1:]``) and returns its exit code."""
    return launcher_main(argv, prog="aiodist.launch", legacy=True)


if __name__ == "__main__":
    sys.exit(main())
