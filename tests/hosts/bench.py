"""``aiodist-bench`` across the hosts of a bed: one command from a bed to rank 0's tables.

Stands a bed up (``hosts.netbed``: each host a network namespace with its own address and host
name, links shaped to ``--rate``), runs the benchmark launched on every host, prints rank 0's
output, writes its JSON, and tears the bed down, whatever happens::

    python -m tests.hosts.bench --hosts 2 --per-host 2 --rate 10gbit -- --compare gloo --json out.json
    python -m tests.hosts.bench --hosts 2 --per-host 2 --rate 1gbit --launcher mpirun -- --compare gloo,mpi

``--launcher aiodist-run`` (default) starts ``aiodist-run --nnodes N --node-rank K`` on each
host; ``--launcher mpirun`` starts Open MPI's ``mpirun`` on the first host, which reaches the
others through ``netbed exec`` (its ``plm_rsh_agent``), so that MPI is measured in the same
processes. Everything after ``--`` goes to ``aiodist-bench``. Needs root (see ``netbed``).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import stat
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .netbed import Bed, Shaping, unavailable

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PORT = 29500  # every bed has a network stack of its own: a fixed port clashes with nothing


def _env(extra: dict[str, str]) -> dict[str, str]:
    keep = {
        k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))
    }
    keep.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "tests"), **extra)
    return keep


def _aiodist_run(bed: Bed, per_host: int, bench: Sequence[str], timeout: float) -> int:
    secret = secrets.token_hex(16)
    master = bed.hosts[0].addr
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, host in enumerate(bed.hosts):
            argv = [
                str(BIN / "aiodist-run"), "--nnodes", str(len(bed.hosts)), "--node-rank", str(k),
                "--master-addr", master, "--master-port", str(PORT), "--nproc-per-node", str(per_host),
                str(BIN / "aiodist-bench"), *bench,
            ]  # fmt: skip
            out = open(Path(tmp, f"node{k}.out"), "w+")  # noqa: SIM115 (read back below)
            procs.append(
                (bed.run(host, argv, env=_env({"AIODIST_SECRET": secret}), stdout=out, stderr=out), out)
            )
        codes = []
        for proc, _ in procs:
            try:
                codes.append(proc.wait(timeout))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(124)
        for k, (_, out) in enumerate(procs):
            out.seek(0)
            text = out.read()
            if k == 0 or codes[k] != 0:
                sys.stdout.write(text if k == 0 else f"# node {k} (exit {codes[k]}):\n{text}")
            out.close()
    return max(codes)


def _mpirun(bed: Bed, per_host: int, bench: Sequence[str], timeout: float) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        # mpirun reaches the other hosts as it would through ssh: ``agent HOST COMMAND...``.
        agent = Path(tmp, "agent")
        netbed = f"{shlex.quote(sys.executable)} -m hosts.netbed exec {shlex.quote(bed.name)}"
        agent.write_text(f'#!/bin/sh\nhost=$1; shift\nexec {netbed} "$host" -- sh -c "$*"\n')
        agent.chmod(agent.stat().st_mode | stat.S_IXUSR)
        hosts = ",".join(f"{h.name}:{per_host}" for h in bed.hosts)
        argv = [
            str(BIN / "mpirun"), "-n", str(per_host * len(bed.hosts)), "--host", hosts, "--bind-to", "none",
            "--mca", "plm_rsh_agent", str(agent), "--mca", "btl_tcp_if_include", "eth0",
            "--mca", "oob_tcp_if_include", "eth0", "-x", "OMP_NUM_THREADS", "-x", "PYTHONPATH",
            # The bed's hosts share this machine's cores: MPI must not spin on a core another
            # host's rank needs (each host alone would look undersubscribed to it).
            "--mca", "mpi_yield_when_idle", "1",
            str(BIN / "aiodist-bench"), *bench,
        ]  # fmt: skip
        env = _env({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
        proc = bed.run(bed.hosts[0], argv, env=env)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            return 124


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    bench = args[args.index("--") + 1 :] if "--" in args else []
    ours = args[: args.index("--")] if "--" in args else args
    p = argparse.ArgumentParser(prog="python -m tests.hosts.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=2, help="hosts of the bed (default 2)")
    p.add_argument("--per-host", type=int, default=1, help="ranks on each host (default 1)")
    p.add_argument(
        "--rate", default=None, help="shape every link to this rate (10gbit, 1gbit); default: unshaped"
    )
    p.add_argument("--launcher", choices=("aiodist-run", "mpirun"), default="aiodist-run")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the job is killed")
    opts = p.parse_args(ours)
    why = unavailable()
    if why:
        print(f"no bed on this machine: {why}", file=sys.stderr)
        return 2
    shaping = Shaping(opts.rate) if opts.rate else None
    with Bed.create(opts.hosts, shaping=shaping) as bed:
        run = _mpirun if opts.launcher == "mpirun" else _aiodist_run
        return run(bed, opts.per_host, bench, opts.timeout)


if __name__ == "__main__":
    sys.exit(main())
