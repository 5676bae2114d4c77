"""A worker that ignores SIGINT and SIGTERM (only SIGKILL ends it); writes ``$OUT_DIR/pid_<RANK>``."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
out = Path(os.environ["OUT_DIR"])
rank = os.environ["RANK"]
(out / f"pid_{rank}.tmp").write_text(str(os.getpid()))
(out / f"pid_{rank}.tmp").rename(out / f"pid_{rank}")
time.sleep(60)
