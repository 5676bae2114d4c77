"""Command line of the launchers, parsed into a frozen :class:`LaunchConfig`.

Flags follow torchrun; each has a dashed and an underscored spelling. Parsing is pure apart
from ``os.cpu_count()`` and the environment defaults: it never binds a port or starts anything,
and problems that are not fatal come back as ``LaunchConfig.notices`` for the caller to print.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["STDOUT", "STDERR", "LaunchConfig", "StreamSpec", "build_parser", "parse_config"]

#: Bits of a stream mask, as in torchrun's ``Std``: 1 stdout, 2 stderr, 3 both.
STDOUT = 1
STDERR = 2

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
DEFAULT_TERM_TIMEOUT = 5.0
TERM_TIMEOUT_ENV = "AIODIST_TERM_TIMEOUT"

# torchrun's dynamic-rendezvous knobs. aiodist only has the static rendezvous (the rank-0 worker
# hosts the store at MASTER_ADDR:MASTER_PORT), so these are accepted for script compatibility
# and ignored with a warning. --rdzv-id is the exception: it names the run, as in torchrun.
_IGNORED_RDZV = ("backend", "endpoint", "conf")


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """Which streams of which local rank a ``--tee``/``--redirects`` value selects.

    Attributes:
        default: mask (``STDOUT | STDERR`` bits) for local ranks not listed in ``per_rank``.
        per_rank: masks for the local ranks given explicitly (``"0:1,1:2"`` syntax).
    """

    default: int = 0
    per_rank: Mapping[int, int] = field(default_factory=dict)

    def mask(self, local_rank: int) -> int:
        """Returns the stream mask for ``local_rank``."""
        return self.per_rank.get(local_rank, self.default)

    @property
    def any(self) -> bool:
        """True if some stream of some rank is selected."""
        return bool(self.default) or any(self.per_rank.values())


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """Everything the supervisor needs to run one node's worker group.

    ``master_port`` is ``None`` when a free port must be picked on loopback for each attempt
    (``--standalone`` or ``--master-port 0``).
    """

    nproc_per_node: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int | None
    max_restarts: int
    log_dir: Path | None
    run_id: str
    role: str
    tee: StreamSpec
    redirects: StreamSpec
    local_ranks_filter: frozenset[int] | None
    term_timeout: float
    program: tuple[str, ...]
    script_args: tuple[str, ...]
    legacy_local_rank_arg: bool = False
    notices: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        """Total number of workers over all nodes."""
        return self.nnodes * self.nproc_per_node

    def global_rank(self, local_rank: int) -> int:
        """The global rank of this node's worker ``local_rank``."""
        return self.node_rank * self.nproc_per_node + local_rank

    def command(self, local_rank: int) -> list[str]:
        """The argv of worker ``local_rank``.

        The legacy launcher puts ``--local_rank=N`` right after the script or module name,
        before the user's arguments, where ``torch.distributed.launch`` put it.
        """
        extra = [f"--local_rank={local_rank}"] if self.legacy_local_rank_arg else []
        return [*self.program, *extra, *self.script_args]


def build_parser(prog: str, *, legacy: bool = False) -> argparse.ArgumentParser:
    """The argument parser of ``aiodist.run`` (or, with ``legacy``, of ``aiodist.launch``)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Start and supervise one node's worker processes for an aiodist (torch.distributed) job.",
        # Abbreviations would let a prefix of a launcher flag swallow the script's own flags.
        allow_abbrev=False,
    )
    _add_topology_flags(parser)
    _add_supervision_flags(parser)
    _add_output_flags(parser)
    _add_program_flags(parser, legacy=legacy)
    return parser


def _add_topology_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--nproc-per-node",
        "--nproc_per_node",
        default="1",
        help='workers on this node: an int, or "auto"/"cpu" for the number of CPUs (default 1)',
    )
    add("--nnodes", default="1", help='number of nodes: N, or "N:N" (elastic MIN:MAX is not supported)')
    add("--node-rank", "--node_rank", type=int, default=0, help="rank of this node, 0..nnodes-1")
    add(
        "--master-addr",
        "--master_addr",
        default=None,
        help=f"address of rank 0 (default {DEFAULT_MASTER_ADDR})",
    )
    add(
        "--master-port",
        "--master_port",
        type=int,
        default=None,
        help=f"port of the store hosted by rank 0 (default {DEFAULT_MASTER_PORT}; 0 picks a free one, single node)",
    )
    add("--standalone", action="store_true", help="single node: pick a free port on 127.0.0.1")
    for name in (*_IGNORED_RDZV, "id"):
        add(f"--rdzv-{name}", f"--rdzv_{name}", dest=f"rdzv_{name}", default=None, help=argparse.SUPPRESS)
    add("--run-id", "--run_id", default=None, help="name of the run (default: --rdzv-id or a timestamp)")
    add("--role", default="default", help="role name given to the workers (ROLE_NAME)")
    add("--local-addr", "--local_addr", default=None, help=argparse.SUPPRESS)


def _add_supervision_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=0,
        help="restarts of the worker group on failure",
    )
    add(
        "--term-timeout",
        "--term_timeout",
        type=float,
        default=None,
        help=f"seconds between SIGTERM and SIGKILL when stopping workers (default ${TERM_TIMEOUT_ENV} or "
        f"{DEFAULT_TERM_TIMEOUT:g})",
    )
    # Accepted for torchrun compatibility; the supervisor is event driven and always spawns.
    add("--monitor-interval", "--monitor_interval", type=float, default=None, help=argparse.SUPPRESS)
    add("--start-method", "--start_method", default=None, help=argparse.SUPPRESS)


def _add_output_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--log-dir",
        "--log_dir",
        type=Path,
        default=None,
        help="write per-rank stdout/stderr logs under this directory",
    )
    add(
        "-t",
        "--tee",
        default="0",
        help='streams copied to the log files as well as the console: 1 stdout, 2 stderr, 3 both, or "0:1,1:2"',
    )
    add(
        "-r",
        "--redirects",
        default="0",
        help="streams written to the log files only (not the console); same syntax as --tee",
    )
    add(
        "--local-ranks-filter",
        "--local_ranks_filter",
        default=None,
        help='show console output of these local ranks only, e.g. "0" or "0,2" (log files keep all)',
    )


def _add_program_flags(parser: argparse.ArgumentParser, *, legacy: bool) -> None:
    add = parser.add_argument
    if legacy:
        add(
            "--use-env",
            "--use_env",
            action="store_true",
            help="do not pass --local_rank=N to the script; it reads LOCAL_RANK from the environment",
        )
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument(
        "-m", "--module", action="store_true", help="run the program as a module, like python -m"
    )
    kind.add_argument(
        "--no-python",
        "--no_python",
        action="store_true",
        help="run the program directly, not through the Python interpreter",
    )
    add("training_script", help="the script (or module, or executable) each worker runs")
    add("training_script_args", nargs=argparse.REMAINDER, help="arguments passed on to the script")


def parse_config(argv: Sequence[str] | None, *, prog: str, legacy: bool = False) -> LaunchConfig:
    """Parses a launcher command line.

    Raises:
        SystemExit: with code 2 and a usage message on a bad flag or value (argparse's way),
            or 0 after ``--help``.
    """
    parser = build_parser(prog, legacy=legacy)
    args = parser.parse_args(argv)
    try:
        return _config_from_args(args, legacy=legacy)
    except ValueError as exc:
        parser.error(str(exc))


def _config_from_args(args: argparse.Namespace, *, legacy: bool) -> LaunchConfig:
    notices: list[str] = []
    standalone = bool(args.standalone)
    nnodes = _parse_nnodes(args.nnodes)
    nproc = _parse_nproc(args.nproc_per_node)
    if not 0 <= args.node_rank < nnodes:
        raise ValueError(
            f"--node-rank {args.node_rank} is out of range for --nnodes {nnodes} (0..{nnodes - 1})"
        )
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    master_addr, master_port = _endpoint(args, standalone, nnodes, notices)
    notices.extend(_ignored_flag_notices(args))
    return LaunchConfig(
        nproc_per_node=nproc,
        nnodes=nnodes,
        node_rank=args.node_rank,
        master_addr=master_addr,
        master_port=master_port,
        max_restarts=args.max_restarts,
        log_dir=args.log_dir,
        run_id=args.run_id or args.rdzv_id or time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}",
        role=args.role,
        tee=parse_stream_spec(args.tee, "--tee"),
        redirects=parse_stream_spec(args.redirects, "--redirects"),
        local_ranks_filter=_parse_rank_filter(args.local_ranks_filter),
        term_timeout=_term_timeout(args.term_timeout),
        program=_program(args),
        script_args=tuple(args.training_script_args),
        legacy_local_rank_arg=legacy and not args.use_env,
        notices=tuple(notices),
    )


def _parse_nnodes(text: str) -> int:
    low, sep, high = text.partition(":")
    try:
        lo, hi = int(low), int(high if sep else low)
    except ValueError:
        raise ValueError(f'--nnodes must be an int or "N:N", got {text!r}') from None
    if lo != hi:
        raise ValueError(
            f"--nnodes {text}: elastic MIN:MAX node counts are not supported; aiodist.run needs a fixed "
            f"number of nodes (use --nnodes {hi}, or --nnodes {hi}:{hi})"
        )
    if lo < 1:
        raise ValueError(f"--nnodes must be >= 1, got {text}")
    return lo


def _parse_nproc(text: str) -> int:
    if text in ("auto", "cpu"):
        # No GPU discovery here: "auto" means one worker per CPU, which is what it means on a CPU host.
        return os.cpu_count() or 1
    try:
        nproc = int(text)
    except ValueError:
        raise ValueError(f'--nproc-per-node must be an int, "auto" or "cpu", got {text!r}') from None
    if nproc < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {nproc}")
    return nproc


def _endpoint(
    args: argparse.Namespace, standalone: bool, nnodes: int, notices: list[str]
) -> tuple[str, int | None]:
    """MASTER_ADDR and MASTER_PORT; a port of ``None`` means "pick a free one per attempt"."""
    if standalone:
        if nnodes != 1:
            raise ValueError(f"--standalone runs a single node, but --nnodes is {nnodes}")
        if args.master_addr is not None or args.master_port is not None:
            notices.append(
                "--standalone picks a free port on 127.0.0.1; --master-addr/--master-port are ignored"
            )
        return DEFAULT_MASTER_ADDR, None
    addr = args.master_addr or DEFAULT_MASTER_ADDR
    port = DEFAULT_MASTER_PORT if args.master_port is None else args.master_port
    if not 0 <= port <= 65535:
        raise ValueError(f"--master-port must be in 0..65535, got {port}")
    if port == 0:
        if nnodes != 1:
            raise ValueError("--master-port 0 (pick a free port) only works with a single node")
        return DEFAULT_MASTER_ADDR if args.master_addr is None else addr, None
    return addr, port


def parse_stream_spec(text: str, flag: str) -> StreamSpec:
    """Parses a ``--tee``/``--redirects`` value: ``"3"`` or ``"0:1,1:2"`` (local rank: mask).

    Raises:
        ValueError: naming ``flag`` when the text is malformed or a mask is outside 0..3.
    """

    def mask(value: str) -> int:
        try:
            bits = int(value)
        except ValueError:
            raise ValueError(f'{flag} takes 0-3 or "rank:mask,...", got {text!r}') from None
        if not 0 <= bits <= 3:
            raise ValueError(f"{flag}: {bits} is not a stream mask (0 none, 1 stdout, 2 stderr, 3 both)")
        return bits

    if ":" not in text:
        return StreamSpec(default=mask(text))
    per_rank: dict[int, int] = {}
    for item in text.split(","):
        rank, _, bits = item.partition(":")
        per_rank[_parse_local_rank(rank, flag)] = mask(bits)
    return StreamSpec(default=0, per_rank=per_rank)


def _parse_local_rank(text: str, flag: str) -> int:
    """Parses a non-negative local rank named in ``flag``'s value."""
    try:
        rank = int(text)
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a local rank") from None
    if rank < 0:
        raise ValueError(f"{flag}: local rank {rank} is negative")
    return rank


def _parse_rank_filter(text: str | None) -> frozenset[int] | None:
    if text is None:
        return None
    return frozenset(
        _parse_local_rank(item, "--local-ranks-filter") for item in text.split(",") if item.strip()
    )


def _term_timeout(flag: float | None) -> float:
    if flag is not None:
        value, source = flag, "--term-timeout"
    elif TERM_TIMEOUT_ENV in os.environ:
        source = TERM_TIMEOUT_ENV
        try:
            value = float(os.environ[TERM_TIMEOUT_ENV])
        except ValueError:
            raise ValueError(
                f"{TERM_TIMEOUT_ENV}={os.environ[TERM_TIMEOUT_ENV]!r} is not a number of seconds"
            ) from None
    else:
        return DEFAULT_TERM_TIMEOUT
    if value < 0:
        raise ValueError(f"{source} must be >= 0 seconds, got {value:g}")
    return value


def _program(args: argparse.Namespace) -> tuple[str, ...]:
    """The argv prefix: interpreter (unbuffered, so output is relayed as it is written) and target."""
    if args.no_python:
        return (args.training_script,)
    if args.module:
        return (sys.executable, "-u", "-m", args.training_script)
    return (sys.executable, "-u", args.training_script)


def _ignored_flag_notices(args: argparse.Namespace) -> list[str]:
    notices = [
        f"--rdzv-{name} is ignored: aiodist.run uses the static rendezvous (rank 0 hosts the store at "
        "MASTER_ADDR:MASTER_PORT)"
        for name in _IGNORED_RDZV
        if getattr(args, f"rdzv_{name}") is not None
    ]
    if args.local_addr is not None:
        notices.append("--local-addr is ignored")
    if args.start_method not in (None, "spawn"):
        notices.append(f"--start-method {args.start_method} is ignored: workers are always new processes")
    return notices
