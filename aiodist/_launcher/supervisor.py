"""Starts, watches, stops and restarts one node's worker group (asyncio, one thread).

How it works: each attempt spawns ``nproc_per_node`` workers, each the leader of its own
session, so that a signal to its process group also reaches the processes it started and none
of them is left behind. Their stdout/stderr are piped into :func:`~aiodist._launcher.relay.pump`
tasks. The supervisor then looks at the workers every ``monitor_interval`` seconds (or at once on
a signal to the launcher) until one has exited non-zero or by a signal, or all have exited 0.
After a failure it gives the others ``FAILURE_GRACE`` seconds to exit on their own (a failure
reaches the other ranks of a collective within milliseconds and they exit with errors of their
own; stopped at once, they would look like victims of the launcher and their errors would be
lost). Stopping sends SIGTERM (or the launcher's own signal) to every live worker's group,
SIGKILL after ``term_timeout`` seconds (at once on a second launcher signal), then SIGKILL to
every worker's group to reap stray children, and drains the pipes. On Linux each worker also
asks the kernel to SIGKILL it if the launcher dies, so even a SIGKILLed launcher leaves no orphans.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import secrets
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from aiodist._launcher.config import STDERR, STDOUT, LaunchConfig
from aiodist._launcher.env import worker_env
from aiodist._launcher.relay import ConsoleWriter, Tail, pump
from aiodist._launcher.summary import WorkerExit, format_summary, root_cause, signal_name
from aiodist._launcher.tracebacks import compress_frames, error_line
from aiodist.transport import shm_segment

__all__ = ["Supervisor", "pick_free_port"]

TAIL_LINES = 20
#: Seconds the other workers get to exit on their own after the first failure, before SIGTERM.
FAILURE_GRACE = 2.0
#: How long to wait for the pipes of exited workers to reach EOF (a detached grandchild may hold them).
DRAIN_TIMEOUT = 2.0
_PR_SET_PDEATHSIG = 1


class WorkerStartError(Exception):
    """A worker process could not be created (e.g. ``--no-python`` with a missing executable)."""


def pick_free_port(host: str) -> int:
    """A TCP port that is free on ``host`` right now (the kernel's choice for port 0).

    Another process may take it before rank 0 binds it; the window is short and a clash shows
    up as a clear bind error in rank 0.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _death_signal_preexec() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the kernel SIGKILL the worker when the launcher dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    launcher = os.getpid()

    def preexec() -> None:
        # Runs in the child between fork and exec: only a C call and two syscalls, no imports.
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != launcher:  # the launcher died before prctl took effect
            os._exit(1)

    return preexec


def _killpg(pid: int, signum: int) -> None:
    """Signals the process group led by worker ``pid``; a group already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)


class _LauncherSignals:
    """Signals to the launcher: the first requests a stop, any further one asks for SIGKILL now."""

    def __init__(self, forwarded: tuple[signal.Signals, ...]) -> None:
        self.forwarded = forwarded  # forwarded to the workers; they end the run with 128 + signum
        self.first: int | None = None
        self.stop = asyncio.Event()
        self.urgent = asyncio.Event()

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for signum in self.forwarded:
            loop.add_signal_handler(signum, self._received, int(signum))

    def uninstall(self, loop: asyncio.AbstractEventLoop) -> None:
        for signum in self.forwarded:
            loop.remove_signal_handler(signum)

    def _received(self, signum: int) -> None:
        if self.first is None:
            self.first = signum
            self.stop.set()
        else:
            self.urgent.set()


@dataclass(eq=False)
class _Worker:
    """One running worker process and the tasks copying its output."""

    local_rank: int
    rank: int
    process: asyncio.subprocess.Process
    tail: Tail
    stderr_log: Path | None
    files: list[BinaryIO]
    pumps: list[asyncio.Task[None]] = field(default_factory=list)
    exit_time: float | None = None
    stopped_by: int | None = None

    def seen_exited(self, now: float) -> bool:
        """True once the process has exited; the first call that sees it records ``now`` as its
        exit time (see :func:`_poll`)."""
        if self.process.returncode is None:
            return False
        if self.exit_time is None:
            self.exit_time = now
        return True

    def ended(self) -> WorkerExit:
        returncode = self.process.returncode
        assert returncode is not None, "ended() is only called on exited workers"  # internal invariant
        stderr = self.tail.lines()
        tail, hidden = compress_frames(stderr)
        return WorkerExit(
            rank=self.rank,
            local_rank=self.local_rank,
            pid=self.process.pid,
            returncode=returncode,
            exit_time=self.exit_time or time.time(),
            stopped_by=self.stopped_by,
            error=error_line(stderr),
            stderr_tail=tuple(tail[-TAIL_LINES:]),
            hidden_frames=hidden,
            stderr_log=self.stderr_log,
        )


def _poll(workers: list[_Worker]) -> list[_Worker]:
    """The workers that have exited. Those this poll sees first get one exit time: the order in
    which it looks at them says nothing of the order in which they exited."""
    now = time.time()
    return [worker for worker in workers if worker.seen_exited(now)]


@dataclass(frozen=True, slots=True)
class _Outcome:
    """How an attempt ended: ``exits`` holds every worker; ``failed`` is False when every worker
    exited 0 (or the launcher was signalled)."""

    exits: tuple[WorkerExit, ...]
    failed: bool


class Supervisor:
    """Runs the local worker group of ``config`` to completion, restarting it on failure.

    Args:
        config: the parsed command line.
        prog: the launcher's name, used in its own messages.
        secret: the ``AIODIST_SECRET`` for the workers, or None to leave it unset.
        environ: the environment the workers' environments are built on.
        stdout, stderr: binary streams the prefixed worker output (and the launcher's messages,
            on ``stderr``) go to.
    """

    def __init__(
        self,
        config: LaunchConfig,
        *,
        prog: str,
        secret: str | None,
        environ: Mapping[str, str],
        stdout: BinaryIO,
        stderr: BinaryIO,
    ) -> None:
        self._config = config
        self._prog = prog
        self._secret = secret
        self._environ = dict(environ)
        # Workers name their shared-memory segments after this token, so that what a worker
        # killed during setup leaves in /dev/shm is swept once the group has exited.
        self._shm_job = self._environ.get("AIODIST_SHM_JOB") or secrets.token_hex(8)
        self._environ["AIODIST_SHM_JOB"] = self._shm_job
        self._stdout = stdout
        self._stderr = stderr
        self._messages = ConsoleWriter(stderr, f"[{prog}] ".encode())
        self._signals = _LauncherSignals(config.signals)
        self._preexec = _death_signal_preexec()
        self._log_root = self._make_log_root()

    def notice(self, message: str) -> None:
        """Prints one of the launcher's own messages to its stderr."""
        self._messages.write([line.encode() + b"\n" for line in message.splitlines()])

    async def run(self) -> int:
        """Runs attempts until success, a final failure or a launcher signal.

        Returns:
            0 if every worker exited 0; 1 if the group failed with no restart left (after a
            summary on stderr) or could not be started; 128 + signum after a launcher signal.
        """
        loop = asyncio.get_running_loop()
        self._signals.install(loop)
        try:
            return await self._run_attempts()
        finally:
            self._signals.uninstall(loop)

    async def _run_attempts(self) -> int:
        config = self._config
        for attempt in range(config.max_restarts + 1):
            if self._signals.first is not None:
                break
            try:
                outcome = await self._run_attempt(attempt)
            except WorkerStartError as exc:
                self.notice(f"error: {exc}")
                return 1
            if self._signals.first is not None:
                break
            if not outcome.failed:
                return 0
            if attempt < config.max_restarts:
                root = root_cause(outcome.exits, world_size=config.world_size)
                cause = "a worker failed" if root is None else root.one_line()
                self.notice(
                    f"worker group failed: {cause}; restarting it (restart {attempt + 1} of {config.max_restarts})"
                )
                continue
            self._stderr_text(
                format_summary(
                    outcome.exits,
                    prog=self._prog,
                    node_rank=config.node_rank,
                    restarts=attempt,
                    max_restarts=config.max_restarts,
                    world_size=config.world_size,
                )
            )
            return 1
        signum = self._signals.first
        assert signum is not None  # the loop only breaks after a launcher signal
        self.notice(f"received {signal_name(signum)}; workers stopped, exiting with {128 + signum}")
        return 128 + signum

    async def _run_attempt(self, attempt: int) -> _Outcome:
        config = self._config
        port = config.master_port if config.master_port is not None else pick_free_port(config.master_addr)
        workers: list[_Worker] = []
        failed = False
        try:
            for local_rank in range(config.nproc_per_node):
                workers.append(await self._spawn(local_rank, attempt, port))
            failed = await self._watch(workers)
        finally:
            first_signal = self._signals.first or signal.SIGTERM
            await self._stop(workers, first_signal)
            shm_segment.sweep(self._shm_job)
        return _Outcome(exits=tuple(worker.ended() for worker in workers), failed=failed)

    async def _spawn(self, local_rank: int, attempt: int, port: int) -> _Worker:
        config = self._config
        env = worker_env(
            config,
            local_rank,
            restart_count=attempt,
            master_port=port,
            secret=self._secret,
            environ=self._environ,
        )
        out_log, err_log = self._log_paths(attempt, local_rank)
        files = {path: path.open("wb") for path in (out_log, err_log) if path is not None}
        try:
            process = await asyncio.create_subprocess_exec(
                *config.command(local_rank),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                start_new_session=True,
                preexec_fn=self._preexec,
            )
        except OSError as exc:
            for handle in files.values():
                handle.close()
            raise WorkerStartError(
                f"cannot start local_rank {local_rank} ({' '.join(config.command(local_rank))}): {exc}"
            ) from exc
        worker = _Worker(
            local_rank=local_rank,
            rank=config.global_rank(local_rank),
            process=process,
            tail=Tail(),
            stderr_log=err_log,
            files=list(files.values()),
        )
        self._start_pumps(
            worker,
            files[out_log] if out_log is not None else None,
            files[err_log] if err_log is not None else None,
        )
        return worker

    def _start_pumps(self, worker: _Worker, out_log: BinaryIO | None, err_log: BinaryIO | None) -> None:
        process = worker.process
        assert process.stdout is not None and process.stderr is not None  # both were requested as PIPE
        prefix = f"[rank {worker.rank}]: ".encode()
        out_console = (
            ConsoleWriter(self._stdout, prefix) if self._on_console(worker.local_rank, STDOUT) else None
        )
        err_console = (
            ConsoleWriter(self._stderr, prefix) if self._on_console(worker.local_rank, STDERR) else None
        )
        worker.pumps = [
            asyncio.create_task(pump(process.stdout, console=out_console, log=out_log, tail=None)),
            asyncio.create_task(pump(process.stderr, console=err_console, log=err_log, tail=worker.tail)),
        ]

    async def _watch(self, workers: list[_Worker]) -> bool:
        """Polls the workers until one fails (True, after the grace period), all exit 0 or the
        launcher is signalled (False)."""
        interval = self._config.monitor_interval
        while not self._signals.stop.is_set():
            exited = _poll(workers)
            if any(worker.process.returncode != 0 for worker in exited):
                await self._grace(workers, interval)
                return True
            if len(exited) == len(workers):
                return False
            await self._sleep_unless_stopped(interval)
        return False

    async def _grace(self, workers: list[_Worker], interval: float) -> None:
        """Lets the other workers exit on their own for up to ``FAILURE_GRACE`` seconds."""
        deadline = time.monotonic() + FAILURE_GRACE
        while len(_poll(workers)) < len(workers) and not self._signals.stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            await self._sleep_unless_stopped(min(interval, left))

    async def _sleep_unless_stopped(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._signals.stop.wait(), seconds)

    async def _stop(self, workers: list[_Worker], signum: int) -> None:
        """Signals live workers, escalates to SIGKILL, reaps stray children, drains the pipes."""
        exited = _poll(workers)
        alive = [worker for worker in workers if worker not in exited]
        for worker in alive:
            worker.stopped_by = signum
            _killpg(worker.process.pid, signum)
        if alive:
            await self._wait_or_kill(alive, signum)
        # A worker's own children (data loaders, shells) would outlive it; its group still holds them.
        for worker in workers:
            _killpg(worker.process.pid, signal.SIGKILL)
        await self._drain(workers)

    async def _wait_or_kill(self, alive: list[_Worker], signum: int) -> None:
        exited = asyncio.ensure_future(asyncio.gather(*(worker.process.wait() for worker in alive)))
        urgent = asyncio.ensure_future(self._signals.urgent.wait())
        either: set[asyncio.Future[Any]] = {exited, urgent}
        await asyncio.wait(either, timeout=self._config.term_timeout, return_when=asyncio.FIRST_COMPLETED)
        urgent.cancel()
        for worker in alive:
            if worker.process.returncode is None:
                self.notice(
                    f"rank {worker.rank} (pid {worker.process.pid}) still running "
                    f"{self._config.term_timeout:g}s after {signal_name(signum)}; sending SIGKILL"
                )
                _killpg(worker.process.pid, signal.SIGKILL)
        await exited
        _poll(alive)

    async def _drain(self, workers: list[_Worker]) -> None:
        pumps = [task for worker in workers for task in worker.pumps]
        if pumps:
            _, pending = await asyncio.wait(pumps, timeout=DRAIN_TIMEOUT)
            for task in pending:
                task.cancel()
            for result in await asyncio.gather(*pumps, return_exceptions=True):
                if isinstance(result, Exception):
                    self.notice(f"warning: lost worker output: {result!r}")
        for worker in workers:
            for handle in worker.files:
                handle.close()

    def _on_console(self, local_rank: int, stream: int) -> bool:
        config = self._config
        if config.local_ranks_filter is not None and local_rank not in config.local_ranks_filter:
            return False
        return not config.redirects.mask(local_rank) & stream

    def _make_log_root(self) -> Path | None:
        """``<log-dir>/<run-id>``; a temporary directory when only --tee/--redirects ask for files."""
        config = self._config
        if config.log_dir is not None:
            root = config.log_dir / config.run_id
        elif config.tee.any or config.redirects.any:
            root = Path(tempfile.mkdtemp(prefix="aiodist_run_")) / config.run_id
        else:
            return None
        self.notice(f"worker logs: {root}")
        return root

    def _log_paths(self, attempt: int, local_rank: int) -> tuple[Path | None, Path | None]:
        """This worker's stdout and stderr log files (None where that stream is not logged)."""
        if self._log_root is None:
            return None, None
        config = self._config
        mask = config.tee.mask(local_rank) | config.redirects.mask(local_rank)
        if not (config.tee.any or config.redirects.any):
            mask = STDOUT | STDERR  # --log-dir alone logs everything
        directory = self._log_root / f"attempt_{attempt}" / str(local_rank)
        if mask:
            directory.mkdir(parents=True, exist_ok=True)
        out = directory / "stdout.log" if mask & STDOUT else None
        err = directory / "stderr.log" if mask & STDERR else None
        return out, err

    def _stderr_text(self, text: str) -> None:
        ConsoleWriter(self._stderr, b"").write([text.encode()])
