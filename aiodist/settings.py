"""Every environment variable aiodist reads, parsed in one place into a typed ``Settings``.

A job reads the environment once, when it starts (``init_process_group``, the torch backend's
first group, a store or transport made on its own): ``Settings.read()`` parses every variable,
and a bad value fails there, naming the variable, before any rendezvous. The parts of the job
are handed the values they need; nothing on the path of an operation reads the environment.

The one setting that changes while a job runs is torch's debug level (``set_debug_level``):
a process-wide value here, read by each collective (``detail_on``), set from ``AIODIST_DEBUG``
(or ``TORCH_DISTRIBUTED_DEBUG``) at import and at every ``Settings.read().apply()``.
"""

from __future__ import annotations

import enum
import logging
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from aiodist.errors import DistValueError
from aiodist.runtime import busy_poll as _busy_poll
from aiodist.runtime import host as _host
from aiodist.runtime.origin import TASK_CHECKS

__all__ = [
    "DebugLevel",
    "Settings",
    "debug_level",
    "debug_level_from_env",
    "detail_on",
    "handshake_timeout",
    "native_engine",
    "secret",
    "set_debug_level",
]

#: ``AIODIST_LINK_TIMEOUT``'s default, seconds: long enough to ride out a switch's failover
#: or a spanning-tree reconvergence, far shorter than a group's default timeout.
LINK_TIMEOUT = 60.0
#: ``AIODIST_HANDSHAKE_TIMEOUT``'s default: seconds a new connection has to authenticate.
HANDSHAKE_TIMEOUT = 10.0
#: ``AIODIST_UNEXPECTED_CAP``'s default: bytes of early arrivals a transport holds for receives.
UNEXPECTED_CAP = 1 << 30
#: ``AIODIST_MAX_OBJECT_BYTES``'s default: serialized bytes one rank may announce in one object collective.
MAX_OBJECT_BYTES = 1 << 30
#: ``AIODIST_RENDEZVOUS_LOG_INTERVAL``'s default: seconds between reports while a rendezvous waits.
RENDEZVOUS_LOG_INTERVAL = 30.0
#: ``AIODIST_BUSY_POLL_US``'s default where every rank of the host has a core to itself.
BUSY_POLL_US = 200.0

HOST_ALGOS = ("auto", "flat", "direct")
SHM_MODES = {"": "on", "1": "on", "on": "on", "true": "on", "yes": "on", "copy": "copy"}
SHM_MODES |= dict.fromkeys(("0", "off", "false", "no"), "off")
TORCH_BACKEND_LEVELS = ("auto", "cpp", "python")
TORCH_DEFAULT_GROUP_MODES = ("auto", "1", "0")
_LOG_NAMES = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class DebugLevel(enum.IntEnum):
    """torch's levels: OFF (default), INFO, DETAIL (the agreement check before each collective)."""

    OFF = 0
    INFO = 1
    DETAIL = 2

    def __str__(self) -> str:
        return f"DebugLevel.{self.name}"


def _number(env: Mapping[str, str], name: str, default: float, advice: str) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value >= 0 and math.isfinite(value)):
        raise DistValueError(f"{name}={raw!r}: {advice}")
    return value


def _count(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit():
        raise DistValueError(f"{name}={raw!r}: give a number of bytes")
    return int(raw)


def _optional_int(env: Mapping[str, str], name: str) -> int | None:
    """An integer launcher variable, or None when unset or not an integer (local knowledge only)."""
    value = env.get(name, "").strip()
    return int(value) if value.lstrip("-").isdigit() else None


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...], default: str = "auto") -> str:
    value = env.get(name, "").strip().lower() or default
    if value not in choices:
        raise DistValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def parse_debug_level(text: str, variable: str) -> DebugLevel:
    """``OFF``, ``INFO`` or ``DETAIL`` (any case).

    Raises:
        DistValueError: anything else (naming ``variable``).
    """
    try:
        return DebugLevel[text.strip().upper()]
    except KeyError:
        raise DistValueError(
            f"Invalid value for {variable}: {text!r}; valid values are OFF, INFO and DETAIL"
        ) from None


def _debug_from(env: Mapping[str, str]) -> DebugLevel:
    """``AIODIST_DEBUG``; anything but a level reads as OFF (only DETAIL changes what runs)."""
    text = env.get("AIODIST_DEBUG", "")
    try:
        return parse_debug_level(text, "AIODIST_DEBUG") if text.strip() else DebugLevel.OFF
    except DistValueError:
        return DebugLevel.OFF


def _log_level(env: Mapping[str, str]) -> int | None:
    raw = env.get("AIODIST_LOG_LEVEL", "")
    text = raw.strip().upper()
    if not text:
        return None
    if text.lstrip("-").isdigit():
        return int(text)
    text = "WARNING" if text == "WARN" else text
    if text not in _LOG_NAMES:
        raise DistValueError(f"AIODIST_LOG_LEVEL={raw!r}: use one of {', '.join(_LOG_NAMES)} (or a number)")
    return int(getattr(logging, text))


def _busy_poll_us(env: Mapping[str, str]) -> float | None:
    raw = env.get("AIODIST_BUSY_POLL_US", "")
    if not raw.strip():
        return None
    try:
        return max(float(raw), 0.0)
    except ValueError:
        raise DistValueError(f"AIODIST_BUSY_POLL_US must be a number of microseconds, got {raw!r}") from None


def _shm_mode(env: Mapping[str, str]) -> str:
    raw = env.get("AIODIST_SHM", "").strip().lower()
    if raw not in SHM_MODES:
        raise DistValueError(f"AIODIST_SHM must be 1, 0 or copy, got {raw!r}")
    return SHM_MODES[raw]


def _shm_job(env: Mapping[str, str]) -> str:
    """``AIODIST_SHM_JOB`` when it can name segments (alphanumeric, at most 64), else ''."""
    value = env.get("AIODIST_SHM_JOB", "").strip()
    return value if value.isalnum() and len(value) <= 64 else ""


def _unexpected_cap(env: Mapping[str, str]) -> int:
    try:
        value = int(env.get("AIODIST_UNEXPECTED_CAP", UNEXPECTED_CAP))
    except ValueError:
        return UNEXPECTED_CAP
    return value if value > 0 else UNEXPECTED_CAP


def torch_default_group(value: str, source: str) -> str:
    """``auto``, ``1`` or ``0`` (``source`` names the setting in the error).

    Raises:
        DistValueError: any other value.
    """
    value = str(value).strip().lower() or "auto"
    if value not in TORCH_DEFAULT_GROUP_MODES:
        raise DistValueError(f"{source}={value!r}: use auto, 1 or 0")
    return value


def handshake_timeout(env: Mapping[str, str] | None = None, default: float = HANDSHAKE_TIMEOUT) -> float:
    """Seconds a new connection has to authenticate: ``AIODIST_HANDSHAKE_TIMEOUT`` or ``default``."""
    try:
        value = float((os.environ if env is None else env).get("AIODIST_HANDSHAKE_TIMEOUT", default))
    except ValueError:
        return default
    return value if value > 0 else default


NATIVE_CHOICES = {"": "auto", "auto": "auto", "1": "on", "on": "on", "0": "off", "off": "off"}


def native_engine(env: Mapping[str, str] | None = None) -> str:
    """``AIODIST_NATIVE``: "auto" (the compiled engine where it was built, default), "on" (it
    must be there), "off" (the Python engine). Read once per process, at the engine's first use
    (``aiodist.native``): the engine is chosen before any job, as pyzmq chooses its
    backend at import."""
    raw = (os.environ if env is None else env).get("AIODIST_NATIVE", "")
    choice = NATIVE_CHOICES.get(raw.strip().lower())
    if choice is None:
        raise DistValueError(f"AIODIST_NATIVE must be 1, 0 or auto, got {raw!r}")
    return choice


def secret(env: Mapping[str, str] | None = None) -> bytes | None:
    """``AIODIST_SECRET`` as bytes, or None when unset or empty."""
    value = (os.environ if env is None else env).get("AIODIST_SECRET", "")
    return value.encode() if value else None


@dataclass(frozen=True, slots=True)
class Settings:
    """What the environment says about a job, read once (``Settings.read``)."""

    # -- the runtime's own switches (docs/guide.md, "Environment variables")
    secret: bytes | None = None  # AIODIST_SECRET
    allow_pickle: bool = False  # AIODIST_ALLOW_PICKLE=1
    max_object_bytes: int = MAX_OBJECT_BYTES  # AIODIST_MAX_OBJECT_BYTES
    debug: DebugLevel = DebugLevel.OFF  # AIODIST_DEBUG
    task_check: str = "auto"  # AIODIST_TASK_CHECK: the default of new groups
    busy_poll_us: float | None = None  # AIODIST_BUSY_POLL_US; None: decided by the host's cores
    shm: str = "on"  # AIODIST_SHM: on | off | copy
    native: str = "auto"  # AIODIST_NATIVE: auto | on | off (checked here; aiodist.native chooses)
    shm_job: str = ""  # AIODIST_SHM_JOB: names this job's segments (the launcher sweeps them)
    host_algos: str = "auto"  # AIODIST_HOST_ALGOS, as given (``checked_host_algos``)
    host_id: str = ""  # AIODIST_HOST_ID: places ranks on "different hosts" (tests)
    listen_host: str = ""  # AIODIST_HOST: address, host name or interface to listen on
    socket_ifname: str = ""  # GLOO_SOCKET_IFNAME (torch's gloo variable, honoured too)
    multicast_if: str = ""  # AIODIST_MULTICAST_IF
    link_timeout: float = LINK_TIMEOUT  # AIODIST_LINK_TIMEOUT (0: no limit)
    handshake_timeout: float = HANDSHAKE_TIMEOUT  # AIODIST_HANDSHAKE_TIMEOUT
    unexpected_cap: int = UNEXPECTED_CAP  # AIODIST_UNEXPECTED_CAP
    rendezvous_log_interval: float = RENDEZVOUS_LOG_INTERVAL  # AIODIST_RENDEZVOUS_LOG_INTERVAL
    log_level: int | None = None  # AIODIST_LOG_LEVEL
    torch_backend: str = "auto"  # AIODIST_TORCH_BACKEND: auto | cpp | python
    # AIODIST_TORCH_DEFAULT_GROUP as given (auto | 1 | 0): checked by the sync face's init, where
    # its own argument, when given, takes precedence (``torch_default_group``).
    torch_default_group: str = ""
    # -- what the launcher (aiodist-run, torchrun, mpirun, Slurm) says about this process
    # (variable, value) of the first of RANK, OMPI_COMM_WORLD_RANK, PMI_RANK, SLURM_PROCID set,
    # and of WORLD_SIZE, OMPI_COMM_WORLD_SIZE, PMI_SIZE, SLURM_NTASKS: parsed where they are
    # used (``rank_and_size``), so a value no init uses fails none.
    rank_var: tuple[str, str] | None = None
    world_size_var: tuple[str, str] | None = None
    master_addr: str | None = None  # MASTER_ADDR
    master_port: str | None = None  # MASTER_PORT (checked where env:// uses it)
    local_rank: int | None = None  # LOCAL_RANK
    local_world_size: int | None = None  # LOCAL_WORLD_SIZE
    node_rank: int | None = None  # GROUP_RANK
    torchelastic_run_id: str | None = None  # TORCHELASTIC_RUN_ID: launched by torchrun/aiodist-run
    agent_store: bool = False  # TORCHELASTIC_USE_AGENT_STORE=True: torchrun's agent hosts the store
    restart_count: str = "0"  # TORCHELASTIC_RESTART_COUNT (checked where the agent store is used)

    @classmethod
    def read(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Parse ``env`` (this process's environment by default).

        Raises:
            DistValueError: a variable holds a value aiodist cannot use (the message names it).
        """
        env = os.environ if env is None else env
        return cls(
            secret=secret(env),
            allow_pickle=env.get("AIODIST_ALLOW_PICKLE", "").strip() == "1",
            max_object_bytes=_count(env, "AIODIST_MAX_OBJECT_BYTES", MAX_OBJECT_BYTES),
            debug=_debug_from(env),
            task_check=_choice(env, "AIODIST_TASK_CHECK", TASK_CHECKS),
            busy_poll_us=_busy_poll_us(env),
            shm=_shm_mode(env),
            native=native_engine(env),
            shm_job=_shm_job(env),
            host_algos=env.get("AIODIST_HOST_ALGOS", "").strip().lower() or "auto",
            host_id=env.get("AIODIST_HOST_ID", "").strip(),
            listen_host=env.get("AIODIST_HOST", "").strip(),
            socket_ifname=env.get("GLOO_SOCKET_IFNAME", "").strip(),
            multicast_if=env.get("AIODIST_MULTICAST_IF", ""),
            link_timeout=_number(
                env, "AIODIST_LINK_TIMEOUT", LINK_TIMEOUT, "give seconds, e.g. 60 (0: no limit)"
            ),
            handshake_timeout=handshake_timeout(env),
            unexpected_cap=_unexpected_cap(env),
            rendezvous_log_interval=_number(
                env,
                "AIODIST_RENDEZVOUS_LOG_INTERVAL",
                RENDEZVOUS_LOG_INTERVAL,
                "must be a number of seconds (0 turns the reports off)",
            ),
            log_level=_log_level(env),
            torch_backend=_choice(env, "AIODIST_TORCH_BACKEND", TORCH_BACKEND_LEVELS),
            torch_default_group=env.get("AIODIST_TORCH_DEFAULT_GROUP", ""),
            rank_var=_first_set(env, _RANK_VARS),
            world_size_var=_first_set(env, _SIZE_VARS),
            master_addr=env.get("MASTER_ADDR"),
            master_port=env.get("MASTER_PORT"),
            local_rank=_optional_int(env, "LOCAL_RANK"),
            local_world_size=_optional_int(env, "LOCAL_WORLD_SIZE"),
            node_rank=_optional_int(env, "GROUP_RANK"),
            torchelastic_run_id=env.get("TORCHELASTIC_RUN_ID"),
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == str(True),
            restart_count=env.get("TORCHELASTIC_RESTART_COUNT", "0").strip() or "0",
        )

    def apply(self) -> Settings:
        """Make this process follow the settings that are process-wide: the debug level, the
        ``aiodist`` logger's level (a handler on stderr where the program configured none), what
        this host is (``runtime.host``) and the busy-poll budget (``runtime.busy_poll``)."""
        set_debug_level(self.debug, export=False)
        if self.log_level is not None:
            _configure_logging(self.log_level)
        _host.learn(self.ranks_on_host, self.host_id)
        _busy_poll.configure(self.busy_poll_us)
        return self

    def checked_host_algos(self) -> str:
        """``AIODIST_HOST_ALGOS``: ``auto``, ``flat`` or ``direct``. Checked where the rendezvous
        can tell every rank (a bad value fails the whole job at once, not one rank).

        Raises:
            DistValueError: any other value.
        """
        if self.host_algos not in HOST_ALGOS:
            raise DistValueError(
                f"AIODIST_HOST_ALGOS={self.host_algos!r}: use one of {', '.join(HOST_ALGOS)}"
            )
        return self.host_algos

    def restart_attempt(self) -> int:
        """``TORCHELASTIC_RESTART_COUNT`` (0 when unset).

        Raises:
            DistValueError: it is not a non-negative integer.
        """
        if not self.restart_count.isdigit():
            raise DistValueError(
                f"environment variable TORCHELASTIC_RESTART_COUNT={self.restart_count!r} is not a non-negative integer"
            )
        return int(self.restart_count)

    def rank_and_size(self, rank: int, world_size: int) -> tuple[int, int]:
        """``rank`` and ``world_size``, each taken from the launcher's variables where it is -1.

        Raises:
            DistValueError: the variable that fills one in is not an integer.
        """
        if rank == -1 and self.rank_var is not None:
            rank = _launcher_int(*self.rank_var)
        if world_size == -1 and self.world_size_var is not None:
            world_size = _launcher_int(*self.world_size_var)
        return rank, world_size

    @property
    def ranks_on_host(self) -> int:
        """Ranks on this host as the launcher says: ``LOCAL_WORLD_SIZE``, else ``WORLD_SIZE``, else 1
        (local knowledge only: ranks need not agree on anything derived from it)."""
        size = self.world_size_var[1].strip() if self.world_size_var else ""
        return max(1, self.local_world_size or (int(size) if size.isdigit() else 1))


# The launchers' rank and world-size variables, in the order they are looked at.
_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
_SIZE_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")


def _first_set(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    return next(((name, env[name]) for name in names if name in env), None)


def _launcher_int(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise DistValueError(f"environment variable {name}={value!r} is not an integer") from None


_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _configure_logging(level: int) -> None:
    logger = logging.getLogger("aiodist")
    logger.setLevel(level)
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_LOG_FORMAT))
    logger.addHandler(handler)


# -- the debug level: process-wide, as torch keeps it ------------------------------------------

_debug = _debug_from(os.environ)
_detail = _debug is DebugLevel.DETAIL


def debug_level() -> DebugLevel:
    """This process's debug level."""
    return _debug


def detail_on() -> bool:
    """True in DETAIL mode: each collective checks agreement across its ranks first."""
    return _detail


def set_debug_level(level: DebugLevel, *, export: bool = True) -> None:
    """Set this process's debug level. With ``export``, ``AIODIST_DEBUG`` follows it, so the
    processes this one starts inherit it, and a later ``Settings.read()`` here reads the same."""
    global _debug, _detail
    _debug, _detail = level, level is DebugLevel.DETAIL
    if export and level is DebugLevel.OFF:
        os.environ.pop("AIODIST_DEBUG", None)
    elif export:
        os.environ["AIODIST_DEBUG"] = level.name


def debug_level_from_env(env: Mapping[str, str] | None = None) -> DebugLevel:
    """``TORCH_DISTRIBUTED_DEBUG`` when set, else ``AIODIST_DEBUG``, else OFF (torch's
    ``set_debug_level_from_env``).

    Raises:
        DistValueError: the variable holds something other than OFF, INFO or DETAIL.
    """
    env = os.environ if env is None else env
    for variable in ("TORCH_DISTRIBUTED_DEBUG", "AIODIST_DEBUG"):
        text = env.get(variable, "")
        if text.strip():
            return parse_debug_level(text, variable)
    return DebugLevel.OFF
