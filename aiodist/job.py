"""A job: this process's membership of one set of connected ranks, and how it ends.

A ``Job`` is the one composition root below the faces. It joins (claims a rank in a store and
connects the peers), owns the connections, numbers the groups made on them, and leaves: one
``close`` runs what its views registered (each aborts its groups and frees what they ran on),
then closes the connections, then the store it owns. The faces are views of a job: the async
face's ``World`` (also the sync face's, run on the loop thread), and torch's groups on the
"aiodist" backend (a job of their own, or the sync face's, lent). One exit hook leaves every job still open on the sync
face's loop thread, newest first, saying how the program ended; a job on a program's own
loop leaves as that loop ends (see ``face.world``).
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable

from aiodist.runtime import loop_thread as _loop_thread
from aiodist.settings import Settings
from aiodist.store import Store
from aiodist.transport.base import Transport, exit_goodbye
from aiodist.transport.mesh import claim_rank, connect_mesh

__all__ = ["Job", "open_jobs"]

log = logging.getLogger("aiodist")

# Called with why the job closes; may return an awaitable.
Teardown = Callable[[str], Awaitable[None] | None]

_lock = threading.Lock()
_open: list[Job] = []  # oldest first; the exit hook leaves them newest first
_exit_hook_registered = False


class Job:
    """The connections of this process to its peers, and their ending.

    Args:
        transport: the connected transport (see ``Job.join``).
        store: a store the job owns and closes last, or None (the caller keeps its store).
    """

    def __init__(self, transport: Transport, store: Store | None = None) -> None:
        self.transport = transport
        self.store = store
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self._teardowns: list[Teardown] = []
        self._next_gid = 1  # 0 is the default group's
        with _lock:
            _open.append(self)
        _register_exit_hook(self.loop)

    @classmethod
    async def join(
        cls,
        store: Store,
        rank: int,
        world_size: int,
        *,
        group_name: str,
        secret: bytes | None,
        host: str,
        timeout: float,
        settings: Settings,
        addr: str | None = None,
    ) -> Job:
        """Claim ``rank`` (-1: the next free one) in ``store`` and connect every other rank.

        ``addr`` (the store's address) only sharpens the messages of a failed claim.
        """
        me = await claim_rank(store, rank, world_size, settings, addr=addr)
        transport = await connect_mesh(
            store,
            me,
            world_size,
            group_name=group_name,
            secret=secret,
            host=host,
            timeout=timeout,
            settings=settings,
        )
        return cls(transport)

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def settings(self) -> Settings:
        """What the environment said when the job started."""
        return self.transport.settings

    def next_gid(self) -> int:
        """A new group id, the same on every member that creates its groups in the same order."""
        gid, self._next_gid = self._next_gid, self._next_gid + 1
        return gid

    def on_close(self, teardown: Teardown) -> None:
        """Run ``teardown(reason)`` when the job closes, before the connections close (the last
        registered runs first). A view aborts its groups there and frees what they ran on."""
        self._teardowns.append(teardown)

    def forget(self, teardown: Teardown) -> None:
        """Withdraw a teardown registered with ``on_close`` (its view closed on its own)."""
        if teardown in self._teardowns:
            self._teardowns.remove(teardown)

    async def close(self, reason: str) -> None:
        """Leave: run the teardowns (what is in flight fails with ``reason``), close the
        connections (peers are told the transport's ``goodbye``), then the owned store.
        Closing a closed job does nothing."""
        if self.closed:
            return
        self.closed = True
        with _lock:
            if self in _open:
                _open.remove(self)
        teardowns, self._teardowns = self._teardowns[::-1], []
        try:
            for teardown in teardowns:
                done = teardown(reason)
                if inspect.isawaitable(done):
                    await done
        finally:
            try:
                await self.transport.aclose()
            finally:
                if self.store is not None:
                    await self.store.aclose()


def open_jobs() -> tuple[Job, ...]:
    """The jobs of this process not closed yet, oldest first."""
    with _lock:
        return tuple(_open)


def _register_exit_hook(loop: asyncio.AbstractEventLoop) -> None:
    """The first job on the sync face's loop thread registers the exit hook. (atexit runs the
    last registered first: the hook runs before the loop thread, started earlier, is stopped.)"""
    global _exit_hook_registered
    lt = _loop_thread.started_loop_thread()
    with _lock:
        if _exit_hook_registered or lt is None or lt.loop is not loop:
            return
        _exit_hook_registered = True
    atexit.register(_leave_at_exit, lt)


def _leave_at_exit(lt: _loop_thread.LoopThread) -> None:
    """Leave every job still open on the loop thread, newest first, saying how the program
    ended. torch scripts often end without ``destroy_process_group``; an orderly leave tells
    the peers this rank is done (not crashed), so ranks still talking among themselves go on:
    they read "rank 1 exited with an uncaught exception (ValueError: boom)", or that it exited."""
    if lt.loop.is_closed():
        return
    goodbye = exit_goodbye()
    with _lock:
        jobs = [j for j in reversed(_open) if j.loop is lt.loop]
    for job in jobs:
        job.transport.goodbye = goodbye
        try:
            lt.run(job.close("the process is exiting"), timeout=10)
        except Exception as exc:  # exiting anyway; say why the leave was not clean
            log.debug("aiodist: leaving a job at exit failed: %s", exc)
