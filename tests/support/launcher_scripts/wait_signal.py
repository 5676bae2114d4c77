"""Announces itself in ``$OUT_DIR/ready_<RANK>``, then waits for SIGINT and records it."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

out = Path(os.environ["OUT_DIR"])
rank = os.environ["RANK"]


def on_signal(signum: int, frame: object) -> None:
    (out / f"got_{signal.Signals(signum).name}_{rank}").touch()
    sys.exit(0)


signal.signal(signal.SIGINT, on_signal)
signal.signal(signal.SIGTERM, on_signal)
(out / f"ready_{rank}").touch()
time.sleep(60)
