"""Run torch's distributed test suite on real gloo and on ``aiodist.sync``; compare.

    python tests/torch_suite/run.py [--world-sizes 2 3] [-k PATTERN] [-j JOBS]
                                    [--timeout 60] [--start-method fork|spawn] [--json PATH]

For each world size: first torch's own gloo (the reference), then the same tests with the suite
module's ``dist`` swapped for ``aiodist.sync`` -- only the tests that passed on gloo. Prints the
counts and one line per test that fails on aiodist; writes a JSON summary (build/torch_suite.json).

The suite is ``torch.testing._internal.distributed.distributed_test`` (class
``DistributedTest._DistTestBase``), as upstream's ``test/distributed/test_distributed_spawn.py``
runs it with BACKEND=gloo: one process per rank per test, file:// rendezvous. Only its
communication tests are chosen (not DDP, SyncBatchNorm, CUDA or NCCL ones). Every test is bounded
by ``--timeout`` (torch's own per-test limit: a hang kills its ranks and fails that test), and each
driver process by a limit of its own, so that nothing stops the run.
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
            BACKEND="gloo",
            WORLD_SIZE=str(world_size),
            AIODIST_TORCH_SUITE=variant,
            AIODIST_TORCH_SUITE_START=args.start_method,
            DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(args.timeout),
            PYTORCH_PRINT_REPRO_ON_FAILURE="0",  # keeps the exception the last line of a failure
            # The suite's object collectives carry instances of its own classes, which need pickle
            # on either runtime; aiodist unpickles only from authenticated peers, so the ranks share
            # a secret, as a user's would (plain data, arrays and tensors travel without it).
            **({"AIODIST_SECRET": secrets.token_hex(16)} if variant == "aiodist" else {}),
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    p.add_argument("-k", dest="patterns", action="append", default=[], help="glob or substring of test names")
    p.add_argument("-j", "--jobs", type=int, default=1, help="driver processes per variant (default 1)")
    p.add_argument("--timeout", type=int, default=60, help="seconds per test (default 60)")
    p.add_argument(
        "--start-method",
        choices=["fork", "spawn"],
        default="fork",
        help="how rank processes start: fork (default; fast) or spawn (as upstream; ~10 s a test)",
    )
    p.add_argument("--json", type=Path, default=ROOT / "build" / "torch_suite.json")
    p.add_argument("--only", choices=["gloo", "aiodist"], help="run one variant (all selected tests)")
    args = p.parse_args(argv)

    names = suite_tests()
    if args.patterns:
        names = [n for n in names if any(fnmatch.fnmatch(n, pat) or pat in n for pat in args.patterns)]
    log_dir = Path(tempfile.mkdtemp(prefix="torch-suite-logs-"))
    print(f"torch suite: {len(names)} communication tests selected; logs in {log_dir}", flush=True)
    t_start = time.monotonic()
    summary: dict[str, Any] = {
        "start_method": args.start_method,
        "timeout_s": args.timeout,
        "world_sizes": {},
    }
    for ws in args.world_sizes:
        t0 = time.monotonic()
        gloo = {} if args.only == "aiodist" else run_variant("gloo", ws, names, args, log_dir)
        reference = names if args.only == "aiodist" else [n for n in names if gloo[n]["status"] == "passed"]
        ours = {} if args.only == "gloo" else run_variant("aiodist", ws, reference, args, log_dir)
        passed = [n for n in reference if ours.get(n, {}).get("status") == "passed"]
        failing = {n: ours[n]["reason"] for n in reference if n in ours and ours[n]["status"] != "passed"}
        secs = round(time.monotonic() - t0, 1)
        print(f"\nworld size {ws} ({secs} s):")
        if gloo:
            print(
                f"  passed on gloo:    {len(reference)} of {len(names)}"
                f" ({sum(r['status'] == 'skipped' for r in gloo.values())} skipped)"
            )
            for n, r in gloo.items():
                if r["status"] == "failed":
                    print(f"    (not counted: fails on gloo) {n}: {r['reason']}")
        if ours:
            print(f"  passed on aiodist: {len(passed)} of {len(reference)}")
        for n, why in failing.items():
            print(f"    FAIL {n}: {ours[n]['status'] if ours[n]['status'] != 'failed' else ''}{why}")
        summary["world_sizes"][str(ws)] = {
            "selected": len(names),
            "gloo": {n: r["status"] for n, r in gloo.items()},
            "aiodist": {n: r["status"] for n, r in ours.items()},
            "passed_on_gloo": len(reference) if gloo else None,
            "passed_on_aiodist": len(passed) if ours else None,
            "aiodist_failures": failing,
            "seconds": secs,
        }
    summary["seconds"] = round(time.monotonic() - t_start, 1)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\ntotal {summary['seconds']} s; summary in {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
