"""Worker that records its environment and argv as JSON in ``$OUT_DIR/rank_<RANK>.json``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

KEYS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "AIODIST_RESTART_COUNT",
    "AIODIST_SECRET",
    "OMP_NUM_THREADS",
    "AIODIST_HOST",
    "CUDA_VISIBLE_DEVICES",
)

record = {"env": {key: os.environ.get(key) for key in KEYS}, "argv": sys.argv[1:]}
Path(os.environ["OUT_DIR"], f"rank_{os.environ['RANK']}.json").write_text(json.dumps(record))
print(f"hello from rank {os.environ['RANK']}")
# A last line without newline: the relay must still print it, prefixed.
print("no newline at the end", end="")
