"""Each worker creates a shared-memory segment under its job's name (as a rank does during
setup, before its peer has mapped it) and is SIGKILLed before it could unlink it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from aiodist.transport.shm_segment import SEGMENT_DIR, Segment

seg = Segment.create(os.environ["AIODIST_SHM_JOB"])
Path(os.environ["OUT_DIR"], f"segment_{os.environ['RANK']}").write_text(os.path.join(SEGMENT_DIR, seg.name))
os.kill(os.getpid(), signal.SIGKILL)
