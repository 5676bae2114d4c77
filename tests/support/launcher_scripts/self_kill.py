"""Rank 0 SIGKILLs itself on every attempt; the others wait. Each attempt leaves a marker file."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

restart = os.environ["AIODIST_RESTART_COUNT"]
assert restart == os.environ["TORCHELASTIC_RESTART_COUNT"]
Path(os.environ["OUT_DIR"], f"attempt_{restart}_rank_{os.environ['RANK']}").touch()
if os.environ["RANK"] == "0":
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
