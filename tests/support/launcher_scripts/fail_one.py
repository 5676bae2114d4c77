"""Rank 1 raises after the others are up; the others wait (rank 0 also starts a grandchild).

``--ignore-term``: the waiting ranks ignore SIGTERM, so only SIGKILL stops them.
Each waiting rank writes its pid (and rank 0 its child's pid) to ``$OUT_DIR``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

out = Path(os.environ["OUT_DIR"])
rank = int(os.environ["RANK"])
if rank == 1:
    # Fail only once every other rank has announced itself, so that there is something to stop.
    deadline = time.monotonic() + 10
    while not (out / "pid_0").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    print("rank 1 is about to fail", file=sys.stderr, flush=True)
    raise ValueError("boom from rank 1")
if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
(out / f"child_{rank}.tmp").write_text(str(child.pid))
(out / f"child_{rank}.tmp").rename(out / f"child_{rank}")
(out / f"pid_{rank}.tmp").write_text(str(os.getpid()))
(out / f"pid_{rank}.tmp").rename(out / f"pid_{rank}")
time.sleep(60)
