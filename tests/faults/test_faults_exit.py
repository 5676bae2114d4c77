"""A rank whose program ends (FAULTS row 28): its peers are told that it exited, and how.

Real interpreters running a script on the blocking face, as a user's would: the face says
goodbye at interpreter exit, and says why (an uncaught exception, or the end of the program).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aiodist.testing import free_port

pytestmark = pytest.mark.timeout(90)

SCRIPT = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import aiodist.sync as dist

    how = sys.argv[1]
    dist.init_process_group("gloo", timeout=60)
    rank = dist.get_rank()
    x = np.ones(4, np.int64)
    dist.all_reduce(x)                        # everybody is connected
    if rank == 1:
        if how == "raise":
            raise ValueError("boom")
        sys.exit(0) if how == "end" else None  # the script simply ends
    try:
        dist.all_reduce(x)                    # needs rank 1, which exits
        print("RESULT no error", flush=True)
    except dist.DistNetworkError as exc:
        print("RESULT", type(exc).__name__, exc, flush=True)
    """
)


def _run(tmp_path: Path, how: str) -> tuple[str, str]:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), how],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=60)
            outs.append((out, err, p.returncode))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    (out0, err0, rc0), (_, err1, _) = outs
    assert rc0 == 0, err0
    lines = [ln for ln in out0.splitlines() if ln.startswith("RESULT")]
    assert len(lines) == 1, (out0, err0)
    return lines[0], err1


def test_uncaught_exception_is_named_by_the_peers(tmp_path: Path) -> None:
    line, err1 = _run(tmp_path, "raise")
    assert "ValueError: boom" in err1  # the rank's own traceback is printed as usual
    assert line.startswith("RESULT DistNetworkError"), line
    assert "rank 1 exited with an uncaught exception (ValueError: boom)" in line, line
    assert "all_reduce #1 on rank 0" in line, line


def test_end_of_program_is_named_by_the_peers(tmp_path: Path) -> None:
    line, _ = _run(tmp_path, "end")
    assert line.startswith("RESULT DistNetworkError"), line
    assert "rank 1 exited (its program ended without destroy_process_group)" in line, line
