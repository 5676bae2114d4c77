"""`make demo`: launch local ranks running each example and show what they did."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PY = sys.executable

# (title, command). Scripts that start their own processes run directly; the rest run
# under the launcher, as a user would run them.
DEMOS: list[tuple[str, list[str]]] = [
    (
        "tutorial: blocking point-to-point, 4 ranks, rank 0 -> rank 3 (sync face, torch tensors)",
        [PY, str(HERE / "p2p_blocking.py")],
    ),
    ("tutorial: non-blocking point-to-point (isend/irecv + wait)", [PY, str(HERE / "p2p_nonblocking.py")]),
    (
        "async pipeline: 4 stages, 16 micro-batches in flight (async face, via aiodist-run)",
        [PY, "-m", "aiodist.run", "--nproc-per-node", "4", str(HERE / "async_pipeline.py")],
    ),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    failures = 0
    for title, cmd in DEMOS:
        print(
            f"\n=== {title}\n$ {' '.join(Path(c).name if c.endswith('.py') else c for c in cmd[1:])}",
            flush=True,
        )
        env = dict(os.environ, MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1")
        start = time.monotonic()
        proc = subprocess.run(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120
        )
        for line in proc.stdout.splitlines():
            print("   ", line)
        status = "ok" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
        print(f"--- {status} in {time.monotonic() - start:.1f} s", flush=True)
        failures += proc.returncode != 0
    print(f"\n{len(DEMOS) - failures} of {len(DEMOS)} demos ran correctly.")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
