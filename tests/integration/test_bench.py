"""Smoke test of ``aiodist-bench``: tiny sizes, 2 ranks; the table's columns and ``#wrong == 0``;
the options that add or leave out parts of the output; the progress line. The performance
targets are not the bench's: the repository's ``tools/bench_targets.py`` judges the JSON it saves
(``tests/unit/test_bench_targets.py``); here only that it reads a real run.

Benchmarks are not tests: nothing here looks at the figures themselves.
"""

from __future__ import annotations

import importlib.util
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from aiodist.bench import cases, report
from aiodist.bench import cli as bench
from aiodist.bench.progress import Progress, format_duration
from aiodist.bench.worker import JobConfig

HAVE_TORCH = importlib.util.find_spec("torch") is not None
TARGETS_TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_targets.py"


def test_parse_size() -> None:
    assert bench.parse_size("4") == 4
    assert bench.parse_size("64K") == 64 << 10
    assert bench.parse_size("1MiB") == 1 << 20
    assert bench.parse_size("2g") == 2 << 30


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("op", cases.COLLECTIVES)
def test_cases_check_their_own_expected_results(op: str, n: int) -> None:
    """A buffer holding the expected result has no wrong element; a corrupted one has one."""
    count = cases.count_for(op, 64, n)
    for rank in range(n):
        bufs = cases.make_buffers(op, count, rank, n)
        cases.fill(op, bufs, rank, n)
        pair = cases.expected(op, bufs, rank, n)
        if pair is None:
            continue
        got, want = pair
        got[:] = want
        assert cases.check(op, bufs, rank, n) == 0
        got[-1] += 1
        assert cases.check(op, bufs, rank, n) == 1


def test_busbw_factors_are_nccl_tests() -> None:
    assert cases.busbw_factor("all_reduce", 4) == 1.5
    assert cases.busbw_factor("all_gather", 4) == 0.75
    assert cases.busbw_factor("reduce_scatter", 2) == 0.5
    assert cases.busbw_factor("all_to_all", 4) == 0.75
    assert cases.busbw_factor("broadcast", 4) == 1.0
    assert cases.busbw_factor("reduce", 4) == 1.0
    assert np.isclose(cases.busbw_factor("all_reduce", 3), 4 / 3)


@pytest.mark.timeout(60)
def test_bench_cli_two_ranks(tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "bench.json"  # type: ignore[operator]
    out_md = tmp_path / "bench.md"  # type: ignore[operator]
    argv = [
        "-np", "2",
        "--faces", "async,sync",
        "--ops", "all_reduce,all_gather,reduce_scatter,broadcast,sendrecv",
        "--sizes", "4,4K",
        "-r", "1", "-n", "2", "-w", "1",
        "--memory", "1M",
        "--json", str(out_json),
        "--markdown", str(out_md),
    ]  # fmt: skip
    if HAVE_TORCH:
        argv += ["--compare", "gloo"]
    rc = bench.main(argv)
    captured = capsys.readouterr()
    text = captured.out
    assert rc == 0, text
    header = re.search(
        r"^#\s+size\s+count\s+type\s+redop\s+root\s+time\(us\)\s+min-max\(us\)\s+algbw\s+busbw\s+#wrong",
        text,
        re.M,
    )
    assert header, text
    # A row: size, count, type, redop, root, then per runtime time, min-max, algbw, busbw, #wrong.
    row = re.search(r"^\s+4096\s+1024\s+float\s+sum\s+-1\s+[\d.]+\s+([\d.]+)-([\d.]+)\s", text, re.M)
    assert row, text
    assert float(row.group(1)) <= float(row.group(2))
    if HAVE_TORCH:
        assert re.search(r"^#\s+size\s.*#wrong\s+vs gloo$", text, re.M), text
    assert "targets" not in text  # the verdicts are repository tooling's, not the bench's
    assert "issue" not in text.lower()
    # The progress line goes to stderr (plain lines here: not a terminal), never to the tables.
    assert "ETA" in captured.err and "ETA" not in text
    assert re.search(r"job 2/2 \(sync 2 ranks\), job done; \d+/\d+ cases", captured.err), captured.err
    data = json.loads(out_json.read_text())
    assert set(data) == {"meta", "jobs"}
    jobs = data["jobs"]
    assert [(j["face"], j["nprocs"]) for j in jobs] == [("async", 2), ("sync", 2)]
    for job in jobs:
        assert "error" not in job, job.get("error")
        ops = {r["op"] for r in job["rows"]}
        assert ops == {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "sendrecv"}
        for row in job["rows"]:
            assert set(row) >= {"size", "count", "type", "redop", "root", "impls"}
            for res in row["impls"].values():
                assert res["wrong"] == 0
                assert res["time_us"] > 0 and res["algbw"] >= 0 and res["busbw"] >= 0
                assert res["min_us"] <= res["time_us"] <= res["max_us"]
                assert res["min_us"] == min(res["reps_us"]) and res["max_us"] == max(res["reps_us"])
        assert [r["op"] for r in job["latency"]] == ["all_reduce", "barrier", "pingpong", "stream"]
        for lat in job["latency"]:
            for res in lat["impls"].values():
                assert res["min_us"] <= res["time_us"] <= res["max_us"]
        assert job["memory"]["aiodist"]
        assert job["memory_bytes"] == 1 << 20
    md = out_md.read_text()
    assert (
        "| size | count | type | redop | root | aiodist time (µs) | min-max (µs) | algbw | busbw | #wrong |"
        in md
    )
    assert "### 2 ranks" in md
    assert "Targets" not in md

    # Replaying the saved run prints the tables (and no targets).
    assert bench.main(["--from-json", str(out_json)]) == 0
    replay = capsys.readouterr().out
    assert re.search(r"^\s+4096\s+1024\s+float\s+sum", replay, re.M), replay
    assert "targets" not in replay

    # The repository's targets tool reads the run the bench saved (its verdicts: its own tests).
    tool = subprocess.run(
        [sys.executable, str(TARGETS_TOOL), str(out_json)], capture_output=True, text=True, timeout=60
    )
    assert tool.returncode == 0, tool.stderr
    if HAVE_TORCH:
        assert "# targets (ratios against gloo and MPI in the same run)" in tool.stdout
        assert re.search(r"^# \d+ of \d+ judged targets hold$", tool.stdout, re.M), tool.stdout
    else:
        assert "# targets: none to judge" in tool.stdout, tool.stdout


def test_memory_probe_only_when_asked() -> None:
    args = bench._parser().parse_args([])
    assert args.memory_bytes == 0
    assert bench._parser().parse_args(["--memory"]).memory_bytes == 64 << 20
    assert bench._parser().parse_args(["--memory", "8M"]).memory_bytes == 8 << 20
    assert JobConfig(face="async", nprocs=2, ops=(), sizes=(), compare=False).memory_bytes == 0


@pytest.mark.parametrize(
    "argv", [["--targets"], ["--compare", "gloo", "--targets", "-np", "2", "--sizes", "4"]]
)
def test_targets_are_no_option_of_the_bench(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """The verdicts are repository tooling (tools/bench_targets.py): the flag is refused, as
    argparse refuses any unknown option, before anything runs."""
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --targets" in err
    assert "--targets" not in bench._parser().format_help()


def test_spread_formatting() -> None:
    assert report.format_spread({"min_us": 44.12, "max_us": 47.25}) == "44.1-47.2"
    assert report.format_spread({"min_us": 36030.7, "max_us": 38000.2}) == "36031-38000"
    # Saved before the spread was recorded: from the repetitions, else nothing to show.
    assert report.format_spread({"time_us": 46.0, "reps_us": [47.0, 45.5, 46.0]}) == "45.5-47.0"
    assert report.format_spread({"time_us": 1.0}) == "-"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _configs() -> list[JobConfig]:
    return [
        JobConfig(face=face, nprocs=2, ops=("all_reduce",), sizes=(4, 1 << 20), compare=True, latency=False)
        for face in ("async", "sync")
    ]


def test_progress_on_a_terminal_redraws_one_line() -> None:
    out = _Terminal()
    p = Progress(_configs(), stream=out)
    p.start_job(0)
    p.step("all_reduce 4 B")
    p.step("all_reduce 1 MiB")
    p.end_job()
    p.close()
    text = out.getvalue()
    assert "\n" not in text
    assert text.count("\r\x1b[K") >= 4 and text.endswith("\r\x1b[K")
    assert "job 1/2 (async 2 ranks), all_reduce 1 MiB; 2/4 cases" in text


def test_progress_elsewhere_writes_plain_lines_with_an_eta(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr("aiodist.bench.progress.time.monotonic", lambda: clock[0])
    out = io.StringIO()
    p = Progress(_configs(), stream=out, interval=10.0)
    p.start_job(0)
    clock[0] += 4.0
    p.step("all_reduce 4 B")  # not shown: within the interval after the start's line
    clock[0] += 1.0
    p.step("all_reduce 1 MiB")  # not shown either
    p.end_job()  # shown: a job's end always is
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [ln.split("), ")[1].split(";")[0] for ln in lines] == ["starting", "job done"]
    assert lines[0].endswith("ETA --:--")
    # Half of the modelled work is done after 5 s: about as long again is left.
    eta = p.eta()
    assert eta is not None and 4.0 < eta < 6.0
    assert lines[-1].endswith(f"ETA {format_duration(eta)}")


def test_format_duration() -> None:
    assert format_duration(5) == "0:05"
    assert format_duration(125.4) == "2:05"
    assert format_duration(3725) == "1:02:05"


def test_the_python_engine_runs_beside_the_compiled_one(tmp_path: Path) -> None:
    """``--aiodist-transports shm,python``: a column per engine, each job on the engine it names."""
    out_json = tmp_path / "bench.json"
    argv = [
        "-np",
        "2",
        "--faces",
        "async",
        "--ops",
        "all_reduce",
        "--sizes",
        "4",
        "-r",
        "1",
        "-n",
        "2",
        "-w",
        "1",
    ]
    argv += ["--aiodist-transports", "shm,python", "--json", str(out_json)]
    assert bench.main(argv) == 0
    jobs = json.loads(out_json.read_text())["jobs"]
    assert [j["aiodist"] for j in jobs] == ["aiodist", "aiodist-py"]
    parts = (
        "aiodist._work",
        "aiodist.transport._shm_ring",
        "aiodist.transport._matching",
        "aiodist.transport._shm_eager",
    )
    assert jobs[1]["engine"] == {part: "python (AIODIST_NATIVE=0)" for part in parts}, jobs[1]
    for part in parts:  # (auto: as built)
        assert jobs[0]["engine"][part].startswith(("compiled", "python (not built")), jobs[0]
    for job in jobs:
        assert "error" not in job, job.get("error")
        assert all(res["wrong"] == 0 for row in job["rows"] for res in row["impls"].values())
