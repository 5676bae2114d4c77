"""Helpers shared by the launcher tests: run ``aiodist.run``/``aiodist.launch`` as a real subprocess.

Worker scripts live in ``tests/support/launcher_scripts``; they report through files in ``$OUT_DIR``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "support" / "launcher_scripts"
RUN_TIMEOUT = 20.0


def launcher_env(out_dir: Path, **extra: str) -> dict[str, str]:
    """The launcher's environment: ours without job variables that would leak into the test."""
    drop = ("AIODIST_SECRET", "OMP_NUM_THREADS", "RANK", "WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PET_")}
    env["OUT_DIR"] = str(out_dir)
    env.update(extra)
    return env


def launch(
    args: list[str], out_dir: Path, *, module: str = "aiodist.run", timeout: float = RUN_TIMEOUT, **extra: str
) -> subprocess.CompletedProcess[str]:
    """Runs the launcher to completion with ``args``; stdout and stderr are captured as text."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=launcher_env(out_dir, **extra),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def records(out_dir: Path) -> dict[int, dict[str, Any]]:
    """rank -> the JSON written by env_dump.py."""
    return {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in out_dir.glob("rank_*.json")}


def alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def assert_gone(pids: list[int], within: float = 3.0) -> None:
    """Fails unless every process in ``pids`` is gone within ``within`` seconds."""
    deadline = time.monotonic() + within
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if alive(pid)], "processes survived the launcher"


def summary_of(stderr: str) -> str:
    """The failure summary the launcher printed at the end of its stderr."""
    assert "worker group failed (" in stderr, stderr
    return stderr[stderr.index("worker group failed (") :]


def summary_field(summary: str, name: str) -> str:
    """The value of a ``  name      : value`` line of the summary's root-cause block."""
    match = re.search(rf"^  {name}\s+: (.*)$", summary, re.MULTILINE)
    assert match, summary
    return match.group(1)


def start_launcher(args: list[str], out_dir: Path, **extra: str) -> subprocess.Popen[str]:
    """Starts ``python -m aiodist.run args`` in the background (the caller kills it in a finally)."""
    return subprocess.Popen(
        [sys.executable, "-m", "aiodist.run", *args],
        cwd=REPO,
        env=launcher_env(out_dir, **extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(paths: list[Path], launcher: subprocess.Popen[str] | None = None, within: float = 30.0) -> None:
    """Waits until every file in ``paths`` exists; fails if ``launcher`` exits first or time runs out."""
    deadline = time.monotonic() + within
    while not all(p.exists() for p in paths):
        assert launcher is None or launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline, f"workers never wrote {paths}"
        time.sleep(0.02)
