"""Smoke test of ``aiodist-bench``: tiny sizes, 2 ranks; the table's columns and ``#wrong == 0``.

Benchmarks are not tests: nothing here looks at the figures themselves.
"""

from __future__ import annotations

import importlib.util
import json
import re

import numpy as np
import pytest

from aiodist import bench
from aiodist._bench import cases

HAVE_TORCH = importlib.util.find_spec("torch") is not None


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
        "--memory-bytes", "1M",
        "--json", str(out_json),
        "--markdown", str(out_md),
    ]  # fmt: skip
    if HAVE_TORCH:
        argv += ["--compare", "gloo"]
    rc = bench.main(argv)
    text = capsys.readouterr().out
    assert rc == 0, text
    header = re.search(
        r"^#\s+size\s+count\s+type\s+redop\s+root\s+time\(us\)\s+algbw\s+busbw\s+#wrong", text, re.M
    )
    assert header, text
    if HAVE_TORCH:
        assert "speedup" in header.group(0) or "speedup" in text
    data = json.loads(out_json.read_text())
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
        assert [r["op"] for r in job["latency"]] == ["all_reduce", "barrier", "pingpong", "stream"]
        assert job["memory"]["aiodist"]
    md = out_md.read_text()
    assert "| size | count | type | redop | root | aiodist time (µs) | algbw | busbw | #wrong |" in md
    assert "### Headline" in md
