"""The repository's benchmark targets (``tools/bench_targets.py``, not part of the package): each
target judged on a saved run as held, not held or not judged (with why), with the figures behind
it; the text and markdown it prints; its exit status (0 whatever the verdicts, 2 for a run it
cannot read).

The tool is imported by its path: ``tools/`` is repository tooling, not a package.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from aiodist.bench import report

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_targets.py"
BIG = 64 << 20


def _load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_targets", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bt = _load_tool()


def _row(op: str, nbytes: int, seconds: dict[str, float]) -> dict[str, Any]:
    """A table row as a run saves it: every rank took ``seconds[name]`` per call of ``name``."""
    reports = [{name: ([t, t, t], 0) for name, t in seconds.items()} for _ in range(2)]
    return report.aggregate(op, nbytes, nbytes // 4, 2, reports)


def _latency(op: str, nbytes: int, seconds: dict[str, float]) -> dict[str, Any]:
    reports = [{name: ([t, t, t], 0) for name, t in seconds.items()} for _ in range(2)]
    return report.latency_row(op, nbytes, 2, reports)


def _job(*, with_mpi: bool = True) -> dict[str, Any]:
    """Two ranks, async face, beside gloo (and MPI): broadcast at 10 GB/s (target 8: held), gloo
    4x slower; all_reduce at 2 GB/s (target 3: not held), MPI twice as fast; a 4 B all_reduce at
    0.05x gloo's time (target 0.1: held); the memory probe adding half a buffer (held)."""
    peers: dict[str, float] = {"mpi": BIG / 12e9} if with_mpi else {}
    rows = [
        _row("broadcast", BIG, {"aiodist": BIG / 10e9, "gloo": 4 * BIG / 10e9, **peers}),
        _row(
            "all_reduce",
            BIG,
            {"aiodist": BIG / 2e9, "gloo": BIG / 1e9, **({"mpi": BIG / 4e9} if with_mpi else {})},
        ),
    ]
    latency = [_latency("all_reduce", 4, {"aiodist": 50e-6, "gloo": 1000e-6})]
    return {
        "face": "async",
        "nprocs": 2,
        "aiodist": "aiodist",
        "compare": "gloo",
        "memory_bytes": BIG,
        "rows": rows,
        "latency": latency,
        "memory": {"aiodist": [BIG // 2, BIG // 4], "gloo": [4 << 20]},
        **({} if with_mpi else {"mpi_error": "mpi4py is not installed"}),
    }


def _by_target(jobs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {v["target"]: v for v in bt.targets(jobs)}


def test_targets_held_and_not_held_with_their_figures() -> None:
    verdicts = _by_target([_job()])
    bcast = verdicts["broadcast 64 MiB: algbw >= 8.0 GB/s"]
    assert bcast["holds"] is True and bcast["figures"].startswith("10.00 GB/s (gloo 2.50, mpi 12.00)")
    ar = verdicts["all_reduce 64 MiB: algbw >= 3.0 GB/s"]
    assert ar["holds"] is False and ar["measured"] == pytest.approx(2.0)
    assert verdicts["all_reduce 64 MiB: algbw >= 2.5 x gloo"]["holds"] is False
    vs_mpi = verdicts["every op >= 1 MiB: algbw >= 0.6 x mpi"]
    assert vs_mpi["holds"] is False and vs_mpi["measured"] == pytest.approx(0.5)
    assert "worst all_reduce 64 MiB: 2.00 vs 4.00 GB/s; 1 of 2 rows below" in vs_mpi["figures"]
    assert vs_mpi["misses"] == ["all_reduce 64 MiB (0.50)"]
    small = verdicts["all_reduce 4 B: time <= 0.1 x gloo"]
    assert small["holds"] is True and small["measured"] == pytest.approx(0.05)
    assert small["figures"] == "50.0 vs 1000.0 us"
    mem = verdicts["64 MiB all_reduce adds <= 1 buffer of RSS"]
    assert mem["holds"] is True and mem["figures"] == "+32.0 MiB per rank (max); gloo +4.0 MiB"
    assert all(
        v["face"] == "async" and v["nprocs"] == 2 and v["impl"] == "aiodist" for v in verdicts.values()
    )


def test_a_target_without_its_peer_is_not_judged_and_says_why() -> None:
    verdicts = _by_target([_job(with_mpi=False)])
    missing = verdicts["every op >= 1 MiB: algbw >= 0.6 x mpi"]
    assert missing["holds"] is None
    assert missing["figures"] == "no mpi figures in this run (mpi4py is not installed)"
    # The gloo ones are still judged.
    assert verdicts["broadcast 64 MiB: algbw >= 8.0 GB/s"]["figures"] == "10.00 GB/s (gloo 2.50)"
    assert verdicts["every op >= 1 MiB: algbw >= 3.0 x gloo"]["holds"] is False


def test_the_default_transport_is_judged_where_it_ran() -> None:
    tcp = {**_job(), "aiodist": "aiodist-tcp"}
    both = bt.targets([tcp, _job()])
    assert both and {v["impl"] for v in both} == {"aiodist"}
    only_tcp = bt.targets([tcp])
    assert only_tcp and {v["impl"] for v in only_tcp} == {"aiodist-tcp"}
    assert bt.targets([{**_job(), "error": "rank 1 died"}]) == []


def test_the_text_names_each_verdict_and_counts_them() -> None:
    verdicts = bt.targets([_job(with_mpi=False)])
    text = bt.format_targets(verdicts)
    lines = text.splitlines()
    assert lines[0] == "# targets (ratios against gloo and MPI in the same run)"
    assert lines[1].startswith("# face ranks aiodist")
    assert "holds: 10.00 GB/s (gloo 2.50)" in text
    assert "NOT HELD: worst all_reduce 64 MiB" in text
    bcast = next(ln for ln in lines if "broadcast 64 MiB: algbw >= 8.0 GB/s" in ln)
    assert " async     2 aiodist " in bcast and " 10.00  holds: " in bcast
    missing = next(ln for ln in lines if "0.6 x mpi" in ln)
    assert "     -  not judged: " in missing
    assert missing.endswith("no mpi figures in this run (mpi4py is not installed)")
    held = sum(1 for v in verdicts if v["holds"])
    judged = sum(1 for v in verdicts if v["holds"] is not None)
    assert 0 < held < judged < len(verdicts)
    assert lines[-1] == f"# {held} of {judged} judged targets hold"
    assert [bt.verdict_word(v) for v in verdicts].count("not judged") == 1
    assert bt.format_targets([]) == ""


def test_the_markdown_section() -> None:
    verdicts = bt.targets([_job(with_mpi=False)])
    md = bt.markdown_targets(verdicts)
    held = sum(1 for v in verdicts if v["holds"])
    judged = sum(1 for v in verdicts if v["holds"] is not None)
    lines = md.splitlines()
    assert lines[0] == f"### Targets ({held} of {judged} judged hold)"
    assert lines[2] == "| face | ranks | aiodist | target | measured | verdict | figures |"
    assert lines[3] == "|---|---:|---:|---:|---:|---:|---:|"
    assert len(lines) == 4 + len(verdicts) and md.endswith("|\n")
    assert (
        "| async | 2 | aiodist | broadcast 64 MiB: algbw >= 8.0 GB/s | 10.00 | holds | 10.00 GB/s (gloo 2.50) |"
        in lines
    )
    assert (
        "| async | 2 | aiodist | all_reduce 64 MiB: algbw >= 3.0 GB/s | 2.00 | **not held** | 2.00 GB/s (gloo 1.00) |"
        in lines
    )
    assert (
        "| async | 2 | aiodist | every op >= 1 MiB: algbw >= 0.6 x mpi | - | not judged | "
        "no mpi figures in this run (mpi4py is not installed) |" in lines
    )
    assert bt.markdown_targets([]).startswith("### Targets\n\nNone to judge")


def _save(path: Path, jobs: list[dict[str, Any]], **extra: Any) -> Path:
    path.write_text(json.dumps({"meta": {"argv": ["--compare", "gloo"]}, "jobs": jobs, **extra}))
    return path


def test_main_prints_the_verdicts_and_exits_0_whatever_they_are(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _save(tmp_path / "run.json", [_job(with_mpi=False)])
    md = tmp_path / "targets.md"
    assert bt.main([str(run), "--markdown", str(md)]) == 0  # targets not held: still 0
    out = capsys.readouterr().out
    verdicts = bt.targets([_job(with_mpi=False)])
    assert out == f"{bt.format_targets(verdicts)}\n# markdown written to {md}\n"
    assert md.read_text() == bt.markdown_targets(verdicts)
    # A verdict list an older aiodist-bench saved in the run is not read: the targets here judge.
    stale = _save(tmp_path / "stale.json", [_job(with_mpi=False)], targets=[{"target": "stale"}])
    assert bt.main([str(stale)]) == 0
    assert capsys.readouterr().out == bt.format_targets(verdicts) + "\n"
    # Nothing to judge (no gloo in the run): one line saying so, still 0.
    alone = _save(tmp_path / "alone.json", [])
    assert bt.main([str(alone)]) == 0
    assert (
        capsys.readouterr().out
        == "# targets: none to judge (they compare against gloo: run aiodist-bench with --compare gloo)\n"
    )


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (None, "No such file"),
        ("{not json", "Expecting property name"),
        ("[1, 2]", "not a run saved by aiodist-bench --json"),
        ('{"meta": {}}', "not a run saved by aiodist-bench --json"),
        ('{"jobs": [{"face": "async"}]}', "not a run saved by aiodist-bench --json (KeyError: 'nprocs')"),
    ],
    ids=["missing", "not-json", "not-an-object", "no-jobs", "not-a-job"],
)
def test_a_run_that_cannot_be_read_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, why: str
) -> None:
    path = tmp_path / "run.json"
    if content is not None:
        path.write_text(content)
    assert bt.main([str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"bench_targets.py: cannot read {path}: ") and why in captured.err


@pytest.mark.integration  # runs the script as a process of its own
def test_the_script_on_a_saved_run(tmp_path: Path) -> None:
    run = _save(tmp_path / "run.json", [_job()])
    md = tmp_path / "targets.md"
    done = subprocess.run(
        [sys.executable, str(TOOL), str(run), "--markdown", str(md)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("# targets (ratios against gloo and MPI in the same run)\n")
    assert "NOT HELD: 2.00 GB/s (gloo 1.00, mpi 4.00)" in done.stdout
    assert md.read_text().startswith("### Targets (")
    missing = subprocess.run(
        [sys.executable, str(TOOL), str(tmp_path / "none.json")], capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 2 and "cannot read" in missing.stderr


def _engine_job(impl: str, nprocs: int = 2, *, pingpong: float, all_reduce: float) -> dict[str, Any]:
    """A sync-face job of ``impl`` beside gloo: 8 B ping-pong and 4 B all_reduce (µs per call),
    a 64 MiB all_reduce at 4 GB/s, and the engine its ranks said they ran."""
    me = {"aiodist": 1.0, "aiodist-py": 1.0}[impl]
    return {
        "face": "sync",
        "nprocs": nprocs,
        "aiodist": impl,
        "compare": "gloo",
        "engine": {"aiodist._work": "compiled" if impl == "aiodist" else "python"},
        "rows": [_row("all_reduce", BIG, {impl: me * BIG / 4e9, "gloo": BIG / 1e9})],
        "latency": [
            _latency("pingpong", 8, {impl: 2 * pingpong * 1e-6, "gloo": 200e-6}),  # (round trips)
            _latency("all_reduce", 4, {impl: all_reduce * 1e-6, "gloo": 200e-6}),
        ],
    }


def test_the_compiled_engines_targets() -> None:
    compiled = _engine_job("aiodist", pingpong=1.5, all_reduce=50.0)
    python = _engine_job("aiodist-py", pingpong=60.0, all_reduce=40.0)
    verdicts = _by_target([compiled, python])
    pp = verdicts["ping-pong 8 B one-way: time <= 2 us"]
    assert pp["holds"] is True and pp["measured"] == pytest.approx(1.5) and pp["figures"] == "1.5 us"
    ar = verdicts["all_reduce 4 B: time <= 4 us"]
    assert ar["holds"] is False and ar["measured"] == pytest.approx(50.0)
    # Slower than the Python engine on one row (50 against 40 us): named.
    vs = verdicts["every row: time <= 1.1 x the Python engine's"]
    assert vs["holds"] is False and vs["measured"] == pytest.approx(1.25)
    assert vs["figures"] == "worst all_reduce 4 B: 1.25; 1 of 3 rows slower"
    assert vs["misses"] == ["all_reduce 4 B (1.25)"]
    # Within the slack everywhere: held.
    level = _by_target([_engine_job("aiodist", pingpong=1.5, all_reduce=41.0), python])
    assert level["every row: time <= 1.1 x the Python engine's"]["holds"] is True
    # Four ranks: the all_reduce against gloo (0.25 x: not held); no absolute targets there.
    four = _by_target([_engine_job("aiodist", 4, pingpong=1.5, all_reduce=50.0)])
    assert four["all_reduce 4 B: time <= 0.2 x gloo"]["holds"] is False
    assert "all_reduce 4 B: time <= 4 us" not in four
    # The Python engine's own job, or a job that ran it, is not judged by them.
    ran_python = {**compiled, "engine": {"aiodist._work": "python"}}
    assert not any(t.endswith(" us") or "Python engine" in t for t in _by_target([ran_python]))
