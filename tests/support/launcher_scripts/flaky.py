"""Fails on the first attempt (rank 0 exits 3), succeeds once restarted."""

from __future__ import annotations

import os
import sys

restart = int(os.environ["AIODIST_RESTART_COUNT"])
print(f"rank {os.environ['RANK']} attempt {restart}")
if restart == 0 and os.environ["RANK"] == "0":
    sys.exit(3)
