"""Run torch's distributed test suite on gloo, then on aiodist two ways; compare.

    python tests/torch_suite/run.py [--mode gloo|facade|backend ...] [--world-sizes 2 3]
                                    [-k PATTERN] [-j JOBS] [--timeout 60]
                                    [--start-method fork|spawn] [--json PATH]

The suite is ``torch.testing._internal.distributed.distributed_test`` (class
``DistributedTest._DistTestBase``), run as upstream's ``test/distributed/test_distributed_spawn.py``
runs it: one process per rank per test, file:// rendezvous. Three modes, all by default:

- ``gloo``: torch's own gloo, the reference;
- ``facade``: the suite module's ``dist`` swapped for ``aiodist.sync`` (its communication tests);
- ``backend``: the suite unmodified with BACKEND=aiodist after ``import aiodist.torch``: every
  process group it creates is on the backend "aiodist" (its communication tests and torch's DDP
  tests on CPU).

For each world size the aiodist modes run the tests that passed on gloo (all selected ones when
gloo is not among the modes). Prints the counts and one line per test that fails, or that the
suite skips for the backend's name; writes a JSON summary (build/torch_suite.json). Every test is
bounded by ``--timeout`` (torch's own per-test limit: a hang kills its ranks and fails that test),
and each driver process by a limit of its own, so that nothing stops the run.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SUITE_FILE = "torch/testing/_internal/distributed/distributed_test.py"

MODES = ("gloo", "facade", "backend")

# Tests of other subsystems than communication: DDP and its helpers, SyncBatchNorm, GPUs.
NOT_COMMUNICATION = re.compile(r"cuda|nccl|DistributedDataParallel|SyncBatchNorm|sync_bn|different_graph")
# Names that do not say "ddp" etc. but whose tests are about models, hooks, loggers or DDP.
OTHER_SUBSYSTEM_WORDS = re.compile(
    r"ddp|batch_norm|model_averag|post_local|sgd|hook|module|static_graph|grad|logger|sampler|join"
    r"|dataloader|checkpoint|optimizer|profiling|namedtuple|unused|detect|forward|device_mesh"
    r"|mixed_precision|bucket|amp|compile|buffer|param|dump_DDP",
    re.IGNORECASE,
)


def suite_tests() -> list[str]:
    """The communication tests of torch's suite, by reading the installed file."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise SystemExit("torch is not installed: the suite comes with it")
    text = (Path(spec.origin).parent.parent / SUITE_FILE).read_text()
    names = sorted(set(re.findall(r"^        def (test_\w+)\(", text, re.MULTILINE)))
    return [n for n in names if not NOT_COMMUNICATION.search(n) and not OTHER_SUBSYSTEM_WORDS.search(n)]


def all_suite_tests() -> list[str]:
    """Every test of the suite's class, as torch instantiates it (parametrized ones included)."""
    code = "import suite; print('\\n'.join(sorted(n for n in dir(suite.TestDistBackendWithSpawn) if n.startswith('test_'))))"
    env = dict(os.environ, BACKEND="gloo", AIODIST_TORCH_SUITE="gloo", PYTHONPATH=str(HERE))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise SystemExit(f"cannot list torch's suite: {proc.stderr.strip().splitlines()[-1:]}")
    return proc.stdout.split()


def run_variant(
    variant: str, world_size: int, names: list[str], args: argparse.Namespace, log_dir: Path
) -> dict[str, dict[str, Any]]:
    """Run ``names`` on ``variant`` in ``args.jobs`` driver processes; results by test name."""
    if not names:
        return {}
    chunks = [names[i :: args.jobs] for i in range(args.jobs)]
    procs: list[tuple[subprocess.Popen[bytes], Path, list[str], Any]] = []
    for i, chunk in enumerate(c for c in chunks if c):
        out = log_dir / f"{variant}-ws{world_size}-{i}.json"
        log = open(log_dir / f"{variant}-ws{world_size}-{i}.log", "wb")  # noqa: SIM115
        env = dict(
            os.environ,
            BACKEND="aiodist" if variant == "backend" else "gloo",
            # The C++ extension or an error: never the Python-only level in its place unnoticed.
            AIODIST_TORCH_BACKEND="cpp",
            WORLD_SIZE=str(world_size),
            AIODIST_TORCH_SUITE=variant,
            AIODIST_TORCH_SUITE_START=args.start_method,
            DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(args.timeout),
            PYTORCH_PRINT_REPRO_ON_FAILURE="0",  # keeps the exception the last line of a failure
            # The suite's object collectives carry instances of its own classes, which need pickle
            # on either runtime; aiodist unpickles only from authenticated peers, so the ranks share
            # a secret, as a user's would (plain data, arrays and tensors travel without it).
            **({"AIODIST_SECRET": secrets.token_hex(16)} if variant == "facade" else {}),
            TEMP_DIR=(temp := tempfile.mkdtemp(prefix="torch-suite-")),
            # file:// as upstream's gloo runs (each test then gets a fresh file of its own).
            INIT_METHOD=f"file://{temp}/init",
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        )
        cmd = [sys.executable, str(HERE / "driver.py"), str(out), *chunk]
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append((proc, out, chunk, log))
    results: dict[str, dict[str, Any]] = {}
    for proc, out, chunk, log in procs:
        # A driver's own bound: every test's limit plus start-up; past it the test in progress
        # and those after it count as failed (killed), and the run goes on.
        limit = len(chunk) * (args.timeout + 30) + 60
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        log.close()
        rows = json.loads(out.read_text()) if out.exists() else []
        for row in rows:
            results[row["name"]] = row
        for name in chunk:
            results.setdefault(
                name, {"name": name, "status": "failed", "reason": "driver killed (hang?)", "seconds": None}
            )
    return results


def build_extension() -> str | None:
    """Build (or load from the cache) the backend's C++ extension once, before the drivers start.

    Returns why it cannot be built, or None.
    """
    code = "import aiodist.torch; aiodist.torch.build()"
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900
        )
    except subprocess.TimeoutExpired:
        return "building the C++ extension took over 900 s"
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        return lines[-1] if lines else f"exit status {proc.returncode}"
    return None


def compare(reference: list[str], results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One aiodist mode's outcome against the reference tests: passed, skipped by the suite, failed."""
    passed = [n for n in reference if results[n]["status"] == "passed"]
    skipped = {n: results[n]["reason"] for n in reference if results[n]["status"] == "skipped"}
    failed = {n: results[n]["reason"] for n in reference if results[n]["status"] == "failed"}
    return {
        "ran": len(reference),
        "passed": len(passed),
        "skipped_by_suite": skipped,
        "failures": failed,
        "status": {n: results[n]["status"] for n in reference},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--mode",
        dest="modes",
        action="append",
        choices=MODES,
        help="gloo (the reference), facade or backend; repeat for several (default: all three)",
    )
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    p.add_argument("-k", dest="patterns", action="append", default=[], help="glob or substring of test names")
    p.add_argument("-j", "--jobs", type=int, default=1, help="driver processes per mode (default 1)")
    p.add_argument("--timeout", type=int, default=60, help="seconds per test (default 60)")
    p.add_argument(
        "--start-method",
        choices=["fork", "spawn"],
        default="fork",
        help="how rank processes start: fork (default; fast) or spawn (as upstream; ~10 s a test)",
    )
    p.add_argument("--json", type=Path, default=ROOT / "build" / "torch_suite.json")
    args = p.parse_args(argv)
    modes = [m for m in MODES if m in (args.modes or MODES)]

    def chosen(names: list[str]) -> list[str]:
        if not args.patterns:
            return names
        return [n for n in names if any(fnmatch.fnmatch(n, pat) or pat in n for pat in args.patterns)]

    communication = suite_tests()
    # The rest of the suite (DDP and its helpers, SyncBatchNorm, CUDA and NCCL tests) runs on
    # the backend only: torch's own DDP runs there on aiodist, and the suite skips what needs GPUs.
    rest = [n for n in all_suite_tests() if n not in set(communication)] if "backend" in modes else []
    communication, rest = chosen(communication), chosen(rest)
    per_mode = {"gloo": communication + rest, "facade": communication, "backend": communication + rest}
    log_dir = Path(tempfile.mkdtemp(prefix="torch-suite-logs-"))
    print(
        f"torch suite: {len(communication)} communication tests and {len(rest)} others (DDP, "
        f"SyncBatchNorm, CUDA) selected; modes {', '.join(modes)}; logs in {log_dir}",
        flush=True,
    )
    t_start = time.monotonic()
    summary: dict[str, Any] = {
        "modes": modes,
        "start_method": args.start_method,
        "timeout_s": args.timeout,
        "selected": {"communication": len(communication), "other": len(rest)},
        "world_sizes": {},
    }
    if "backend" in modes and (why := build_extension()) is not None:
        print(f"backend mode left out: the C++ extension cannot be built here: {why}", flush=True)
        summary["backend_left_out"] = why
        modes.remove("backend")
    for ws in args.world_sizes:
        t0 = time.monotonic()
        row: dict[str, Any] = {}
        gloo = run_variant("gloo", ws, per_mode["gloo"], args, log_dir) if "gloo" in modes else {}
        if gloo:
            row["gloo"] = {n: r["status"] for n, r in gloo.items()}
            row["passed_on_gloo"] = sum(r["status"] == "passed" for r in gloo.values())
        for mode in ("facade", "backend"):
            if mode not in modes:
                continue
            names = per_mode[mode]
            reference = [n for n in names if gloo[n]["status"] == "passed"] if gloo else names
            row[mode] = compare(reference, run_variant(mode, ws, reference, args, log_dir))
        row["seconds"] = round(time.monotonic() - t0, 1)
        summary["world_sizes"][str(ws)] = row
        print_world_size(ws, row, gloo, per_mode)
    summary["seconds"] = round(time.monotonic() - t_start, 1)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\ntotal {summary['seconds']} s; summary in {args.json}")
    return 0


def print_world_size(
    ws: int, row: dict[str, Any], gloo: dict[str, dict[str, Any]], per_mode: dict[str, list[str]]
) -> None:
    print(f"\nworld size {ws} ({row['seconds']} s):")
    if gloo:
        for mode in ("facade", "backend"):
            if mode in row:
                names = per_mode[mode]
                skipped = sum(gloo[n]["status"] == "skipped" for n in names)
                print(
                    f"  passed on gloo ({mode}'s tests): {row[mode]['ran']} of {len(names)} ({skipped} skipped)"
                )
        for n, r in gloo.items():
            if r["status"] == "failed":
                print(f"    (not counted: fails on gloo) {n}: {r['reason']}")
    for mode in ("facade", "backend"):
        if mode not in row:
            continue
        res = row[mode]
        label = "aiodist.sync" if mode == "facade" else 'backend "aiodist"'
        print(f"  passed on {label}: {res['passed']} of {res['ran']}", end="")
        print(f" ({len(res['skipped_by_suite'])} skipped by the suite)" if res["skipped_by_suite"] else "")
        for n, why in res["skipped_by_suite"].items():
            print(f"    SKIP {n}: {why}")
        for n, why in res["failures"].items():
            print(f"    FAIL {n}: {why}")


if __name__ == "__main__":
    raise SystemExit(main())
