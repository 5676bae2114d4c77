"""Command line of the launchers, parsed into a frozen :class:`LaunchConfig`.

Flags follow torchrun 2.13; each has a dashed and an underscored spelling, and, as under
torchrun, an unset flag takes its value from ``PET_<FLAG>`` in the environment (``PET_NNODES=2``).
Every torchrun flag either works or is refused with a message saying why (:data:`REFUSED_FLAGS`);
none is accepted and ignored. Parsing reads the environment, the CPU (or CUDA device) count and
whether the program exists; it never binds a port or starts anything, and problems that are not
fatal come back as ``LaunchConfig.notices`` for the caller to print.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import shutil
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["REFUSED_FLAGS", "STDERR", "STDOUT", "LaunchConfig", "StreamSpec", "build_parser", "parse_config"]

#: Bits of a stream mask, as in torchrun's ``Std``: 1 stdout, 2 stderr, 3 both.
STDOUT = 1
STDERR = 2

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
#: torchrun's port for a ``--rdzv-endpoint`` given without one.
DEFAULT_RDZV_PORT = 29400
DEFAULT_TERM_TIMEOUT = 5.0
TERM_TIMEOUT_ENV = "AIODIST_TERM_TIMEOUT"
#: torchrun's variable for the same grace period, honoured after ours.
TORCH_TERM_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
DEFAULT_MONITOR_INTERVAL = 0.1
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
#: The rendezvous backends that mean "rank 0 hosts a TCP store at this address" here.
RDZV_BACKENDS = ("static", "c10d")

#: torchrun flags that aiodist.run refuses, with the reason shown to the user.
REFUSED_FLAGS: Mapping[str, str] = {
    "rdzv_conf": "aiodist.run has no rendezvous configuration: the rendezvous waits as long as the "
    "timeout given to init_process_group",
    "duplicate_stdout_filters": "use --log-dir (or --tee) and grep the per-rank logs",
    "duplicate_stderr_filters": "use --log-dir (or --tee) and grep the per-rank logs",
    "logs_specs": "custom LogsSpecs plug-ins are a torchrun feature; --log-dir, --tee and --redirects "
    "choose the logs here",
    "numa_binding": "aiodist.run does not bind workers to NUMA nodes; wrap the program with "
    "numactl (--no-python numactl ... python train.py) instead",
}


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
    monitor_interval: float = DEFAULT_MONITOR_INTERVAL
    signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    local_addr: str | None = None
    virtual_local_rank: bool = False

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
        epilog="Not supported (refused with the reason): "
        + ", ".join("--" + dest.replace("_", "-") for dest in REFUSED_FLAGS)
        + ", --rdzv-backend other than static/c10d, --nnodes MIN:MAX. An unset flag is read from "
        "$PET_<FLAG> (PET_NPROC_PER_NODE=4), as torchrun does.",
    )
    parser.add_argument("--version", action="version", version=f"aiodist {_version()}")
    _add_topology_flags(parser)
    _add_supervision_flags(parser)
    _add_output_flags(parser)
    _add_program_flags(parser, legacy=legacy)
    for dest in REFUSED_FLAGS:
        flag = dest.replace("_", "-")
        parser.add_argument(f"--{flag}", f"--{dest}", dest=dest, default=None, help=argparse.SUPPRESS)
    _defaults_from_environment(parser)
    return parser


def _version() -> str:
    try:
        return importlib.metadata.version("aiodist")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def _defaults_from_environment(parser: argparse.ArgumentParser) -> None:
    """torchrun's convention: an unset flag ``--foo-bar`` takes ``$PET_FOO_BAR`` (``1``/``0`` for switches)."""
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "version"):
            continue
        value = os.environ.get(f"PET_{action.dest.upper()}")
        if value is None:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            action.default = value.strip() not in ("", "0")
        else:
            action.default = value  # argparse converts a string default with the action's type


def _add_topology_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--nproc-per-node",
        "--nproc_per_node",
        default="1",
        help='workers on this node: an int, "cpu" (one per CPU), "gpu" (one per CUDA device) or "auto" '
        "(gpu if there is one, else cpu); default 1",
    )
    add("--nnodes", default="1", help='number of nodes: N, or "N:N" (elastic MIN:MAX is not supported)')
    add(
        "--node-rank",
        "--node_rank",
        type=int,
        default=None,
        help="rank of this node, 0..nnodes-1 (default 0)",
    )
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
    add(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        default=None,
        help=f"torchrun's spelling of --master-addr/--master-port: HOST[:PORT] (port {DEFAULT_RDZV_PORT} "
        "if none) where rank 0, on the node with --node-rank 0, hosts the store",
    )
    add(
        "--rdzv-backend",
        "--rdzv_backend",
        default=None,
        help="static or c10d: both mean that rank 0 hosts a TCP store at the endpoint (others are refused)",
    )
    add("--rdzv-id", "--rdzv_id", default=None, help="the job's id; names the run, like --run-id")
    add("--run-id", "--run_id", default=None, help="name of the run (default: --rdzv-id or a timestamp)")
    add("--role", default="default", help="role name given to the workers (ROLE_NAME)")
    add(
        "--local-addr",
        "--local_addr",
        default=None,
        help="the address this node's workers accept connections on (sets AIODIST_HOST for them)",
    )


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
        help=f"seconds between SIGTERM and SIGKILL when stopping workers (default ${TERM_TIMEOUT_ENV}, "
        f"${TORCH_TERM_TIMEOUT_ENV} or {DEFAULT_TERM_TIMEOUT:g})",
    )
    add(
        "--shutdown-timeout",
        "--shutdown_timeout",
        dest="term_timeout",
        type=float,
        help="torchrun's name for --term-timeout",
    )
    add(
        "--monitor-interval",
        "--monitor_interval",
        type=float,
        default=DEFAULT_MONITOR_INTERVAL,
        help=f"seconds between two looks at the workers' state (default {DEFAULT_MONITOR_INTERVAL:g})",
    )
    add(
        "--start-method",
        "--start_method",
        choices=("spawn", "fork", "forkserver"),
        default="spawn",
        help="accepted for torchrun: a script or module always runs in a new process, as under torchrun",
    )
    add(
        "--event-log-handler",
        "--event_log_handler",
        default="null",
        help='only "null" (torchrun\'s default): aiodist.run has no event log handlers',
    )
    add(
        "--signals-to-handle",
        "--signals_to_handle",
        default=DEFAULT_SIGNALS,
        help=f"launcher signals forwarded to the workers (default {DEFAULT_SIGNALS})",
    )


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
    add(
        "--run-path",
        "--run_path",
        action="store_true",
        help="run the script as a Python file (torchrun's run_path mode; takes precedence over --no-python)",
    )
    add(
        "--virtual-local-rank",
        "--virtual_local_rank",
        action="store_true",
        help="give every worker LOCAL_RANK=0 and only its own GPU in CUDA_VISIBLE_DEVICES",
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
    _refuse_unsupported(args)
    notices: list[str] = []
    standalone = bool(args.standalone)
    nnodes = _parse_nnodes(args.nnodes)
    nproc = _parse_nproc(args.nproc_per_node)
    if args.node_rank is None and nnodes > 1 and args.rdzv_endpoint is not None:
        # torchrun's c10d rendezvous numbers the nodes as they join; here each node says which it is.
        raise ValueError(
            f"--nnodes {nnodes} with --rdzv-endpoint needs --node-rank on each node: aiodist.run does not "
            "number the nodes as they join; give --node-rank 0 on the host of the endpoint and 1.."
            f"{nnodes - 1} on the others"
        )
    node_rank = 0 if args.node_rank is None else args.node_rank
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank} is out of range for --nnodes {nnodes} (0..{nnodes - 1})")
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if not args.monitor_interval > 0:
        raise ValueError(f"--monitor-interval must be > 0 seconds, got {args.monitor_interval:g}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if args.virtual_local_rank and visible is not None and len(visible.split(",")) < nproc:
        raise ValueError(
            f"--virtual-local-rank with {nproc} workers, but CUDA_VISIBLE_DEVICES={visible} lists fewer devices"
        )
    master_addr, master_port = _endpoint(args, standalone, nnodes, notices)
    return LaunchConfig(
        nproc_per_node=nproc,
        nnodes=nnodes,
        node_rank=node_rank,
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
        monitor_interval=args.monitor_interval,
        signals=_parse_signals(args.signals_to_handle),
        local_addr=args.local_addr,
        virtual_local_rank=args.virtual_local_rank,
    )


def _refuse_unsupported(args: argparse.Namespace) -> None:
    """Refuses the torchrun flags and values that have no meaning here (never ignores them)."""
    for dest, why in REFUSED_FLAGS.items():
        if getattr(args, dest) not in (None, "", "null"):
            raise ValueError(f"--{dest.replace('_', '-')} is not supported: {why}")
    backend = args.rdzv_backend
    if backend is not None and backend not in RDZV_BACKENDS:
        raise ValueError(
            f"--rdzv-backend {backend} is not supported: aiodist.run has one rendezvous, where rank 0 hosts "
            "a TCP store at --rdzv-endpoint (or --master-addr:--master-port); use --rdzv-backend c10d or "
            "static, or leave it out"
        )
    if args.event_log_handler != "null":
        raise ValueError(
            f"--event-log-handler {args.event_log_handler} is not supported: aiodist.run has no event log "
            "handlers (only the default, null)"
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
    if text in ("auto", "cpu", "gpu"):
        gpus = _cuda_device_count() if text != "cpu" else 0
        if text == "gpu" and not gpus:
            raise ValueError("--nproc-per-node gpu: no CUDA device is visible (torch sees none)")
        return gpus or os.cpu_count() or 1
    try:
        nproc = int(text)
    except ValueError:
        raise ValueError(
            f'--nproc-per-node must be an int, "auto", "cpu" or "gpu", got {text!r}'
            + (" (XPU devices are not supported)" if text == "xpu" else "")
        ) from None
    if nproc < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {nproc}")
    return nproc


def _cuda_device_count() -> int:
    """CUDA devices torch sees (0 without torch): what torchrun's "auto" and "gpu" count."""
    if importlib.util.find_spec("torch") is None:
        return 0
    import torch  # only for "auto"/"gpu": importing torch costs a second or two

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def _endpoint(
    args: argparse.Namespace, standalone: bool, nnodes: int, notices: list[str]
) -> tuple[str, int | None]:
    """MASTER_ADDR and MASTER_PORT; a port of ``None`` means "pick a free one per attempt"."""
    if standalone:
        if nnodes != 1:
            raise ValueError(f"--standalone runs a single node, but --nnodes is {nnodes}")
        given = [
            flag
            for flag, value in (
                ("--master-addr", args.master_addr),
                ("--master-port", args.master_port),
                ("--rdzv-endpoint", args.rdzv_endpoint),
            )
            if value is not None
        ]
        if given:
            notices.append(
                f"--standalone picks a free port on 127.0.0.1; {'/'.join(given)} ignored, as under torchrun"
            )
        return DEFAULT_MASTER_ADDR, None
    addr, port = args.master_addr, args.master_port
    if args.rdzv_endpoint is not None:
        addr, port = _rdzv_endpoint(args.rdzv_endpoint, args.master_addr, args.master_port)
    addr = addr or DEFAULT_MASTER_ADDR
    port = DEFAULT_MASTER_PORT if port is None else port
    if not 0 <= port <= 65535:
        raise ValueError(f"--master-port must be in 0..65535, got {port}")
    if port == 0:
        if nnodes != 1:
            raise ValueError("--master-port 0 (pick a free port) only works with a single node")
        return addr, None
    return addr, port


def _rdzv_endpoint(text: str, master_addr: str | None, master_port: int | None) -> tuple[str, int]:
    """``--rdzv-endpoint HOST[:PORT]`` (``[v6]:PORT`` for IPv6), checked against --master-addr/port."""
    host, port_text = text.strip(), ""
    if host.startswith("["):
        bracket = host.find("]")
        host, port_text = host[1:bracket], host[bracket + 1 :].removeprefix(":")
    elif host.count(":") == 1:
        host, port_text = host.split(":")
    try:
        port = int(port_text) if port_text else DEFAULT_RDZV_PORT
    except ValueError:
        raise ValueError(f"--rdzv-endpoint {text!r}: the port {port_text!r} is not a number") from None
    if not host:
        raise ValueError(f"--rdzv-endpoint {text!r} names no host (HOST:PORT)")
    for flag, given, derived in (("--master-addr", master_addr, host), ("--master-port", master_port, port)):
        if given is not None and given != derived:
            raise ValueError(f"--rdzv-endpoint {text} and {flag} {given} disagree: give one of them")
    return host, port


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
    else:
        source = next((name for name in (TERM_TIMEOUT_ENV, TORCH_TERM_TIMEOUT_ENV) if name in os.environ), "")
        if not source:
            return DEFAULT_TERM_TIMEOUT
        try:
            value = float(os.environ[source])
        except ValueError:
            raise ValueError(f"{source}={os.environ[source]!r} is not a number of seconds") from None
    if value < 0:
        raise ValueError(f"{source} must be >= 0 seconds, got {value:g}")
    return value


def _parse_signals(text: str) -> tuple[signal.Signals, ...]:
    """``--signals-to-handle``: signal names (``SIGUSR1`` or ``USR1``) or numbers, comma separated."""
    found: list[signal.Signals] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name = item.upper() if item.upper().startswith("SIG") else "SIG" + item.upper()
        try:
            signum = signal.Signals(int(item)) if item.isdigit() else signal.Signals[name]
        except (KeyError, ValueError):
            raise ValueError(f"--signals-to-handle: {item!r} is not a signal") from None
        if signum in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            raise ValueError(f"--signals-to-handle: {signum.name} cannot be handled and forwarded")
        found.append(signum)
    return tuple(dict.fromkeys(found))


def _program(args: argparse.Namespace) -> tuple[str, ...]:
    """The argv prefix: interpreter (unbuffered, so output is relayed as it is written) and target.

    Raises:
        ValueError: when the script, module or executable does not exist here, so that no
            worker starts only to fail with the same error N times.
    """
    target = args.training_script
    if args.run_path and args.module:
        raise ValueError("--run-path runs a script file; it cannot be combined with -m/--module")
    if args.no_python and not args.run_path:
        if shutil.which(target) is None:
            raise ValueError(f"--no-python {target}: no such executable (not a file, nor on PATH)")
        return (target,)
    if args.module:
        if not _module_exists(target):
            raise ValueError(
                f"-m {target}: no module named {target!r} (looked in the current directory and sys.path)"
            )
        return (sys.executable, "-u", "-m", target)
    if not os.path.exists(target):
        # As under torchrun, the program is a Python file unless --no-python says otherwise; an
        # installed command (aiodist-bench) is a common slip, so say how to run it.
        hint = (
            f"; {target} is a command on PATH: run it with --no-python {target}"
            if os.sep not in target and shutil.which(target) is not None
            else ""
        )
        raise ValueError(f"{target}: no such file (the script each worker would run){hint}")
    return (sys.executable, "-u", target)


def _module_exists(name: str) -> bool:
    """Whether ``python -m name`` run here would find the module, without importing any of it.

    The top-level name goes through every import finder (editable installs use their own);
    submodules are looked up on the path of their parent package.
    """
    top, *rest = name.split(".")
    saved = sys.path[:]
    sys.path.insert(0, os.getcwd())  # python -m puts the current directory first
    try:
        spec = importlib.util.find_spec(top)
        for part in rest:
            if spec is None or spec.submodule_search_locations is None:
                return False
            spec = importlib.machinery.PathFinder.find_spec(part, list(spec.submodule_search_locations))
    except (ImportError, ValueError):
        return True  # a finder failed: let the worker import it and report the real error
    finally:
        sys.path[:] = saved
    return spec is not None
