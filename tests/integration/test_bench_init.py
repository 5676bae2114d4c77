"""The init benchmark of the repository's tooling (``tools/bench_init.py``) runs and reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_init.py"


def test_two_ranks_join_and_the_run_is_saved(tmp_path: Path) -> None:
    out = tmp_path / "init.json"
    proc = subprocess.run(
        [sys.executable, str(TOOL), "-np", "2", "-r", "1", "--peers", "aiodist", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(out.read_text())
    assert row["ranks"] == 2 and row["peer"] == "aiodist"
    assert 0 < row["init_s"] <= row["ready_s"]
    assert f"| 2 | aiodist | {row['init_s']:.2f} |" in proc.stdout
