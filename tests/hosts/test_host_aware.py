"""The host-aware forms across real hosts: they run, and they agree with the flat forms.

A job on 2 hosts x 2 ranks runs the same operations on the same random data twice, with
``AIODIST_HOST_ALGOS=auto`` (the hierarchical forms for small buffers; for large ones the
two-level all_reduce and all_gather and the host-ordered chains) and ``flat``. The test recomputes every result from the ranks'
seeds: integers must be exact in both runs, floats equal to a float64 reference to within
their summation error, and the two runs equal to each other likewise.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hosts.conftest import MakeBed
from hosts.jobs import Job
from hosts.scripts.agree import DTYPES, SIZES, inputs

pytestmark = pytest.mark.timeout(120)

HOSTS, NPROC = 2, 2
SIZE = HOSTS * NPROC


def close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    if got.dtype.kind == "i":
        np.testing.assert_array_equal(got, want, err_msg=what)
    else:  # 4 terms summed in some order: a few ulps of the largest term
        tol = 8 * np.finfo(got.dtype).eps * SIZE
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 4, err_msg=what)


def test_hierarchical_forms_run_and_agree_with_flat(make_bed: MakeBed, tmp_path: Path) -> None:
    bed = make_bed(HOSTS)
    runs = {}
    for mode in ("auto", "flat"):
        job = Job(bed, "agree.py", nproc=NPROC, out_dir=tmp_path / mode, env={"AIODIST_HOST_ALGOS": mode})
        assert job.start().wait(100) == [0] * HOSTS, job.report()
        runs[mode] = [np.load(tmp_path / mode / f"rank_{r}.npz") for r in range(SIZE)]
        paths = [
            set((tmp_path / mode / f"rank_{r}.paths").read_text().split("\n")) - {""} for r in range(SIZE)
        ]
        for r, seen in enumerate(paths):
            if mode == "flat":
                assert seen == set(), (r, seen)
                continue
            for op in ("all_reduce", "broadcast", "reduce", "all_gather"):
                assert f"{op} hierarchical" in seen, (r, op, seen)
            # Large: two levels where both hosts have two ranks sharing memory, a chain in host order.
            for op in ("all_reduce", "all_gather"):
                assert f"{op} two-level" in seen, (r, op, seen)
            assert "broadcast host-ordered" in seen, (r, seen)
    for label, n in SIZES:
        for dtype in DTYPES:
            every = [inputs(r, n, dtype) for r in range(SIZE)]
            wide = np.stack(every).astype(np.float64 if dtype != "int64" else np.int64)
            for mode, res in runs.items():
                for r in range(SIZE):
                    what = f"{mode} run, rank {r}, {label} {dtype}"
                    close(
                        res[r][f"all_reduce/{label}/{dtype}"],
                        wide.sum(0).astype(dtype),
                        f"all_reduce: {what}",
                    )
                    np.testing.assert_array_equal(res[r][f"all_reduce_max/{label}/{dtype}"], np.max(every, 0))
                    np.testing.assert_array_equal(res[r][f"all_gather/{label}/{dtype}"], np.stack(every))
                    for root in range(SIZE):
                        np.testing.assert_array_equal(res[r][f"broadcast{root}/{label}/{dtype}"], every[root])
                    close(res[r][f"reduce{r}/{label}/{dtype}"], wide.sum(0).astype(dtype), f"reduce: {what}")
            for r in range(SIZE):  # hierarchical against flat
                key = f"all_reduce/{label}/{dtype}"
                close(runs["auto"][r][key], runs["flat"][r][key], f"auto vs flat, rank {r}, {key}")
