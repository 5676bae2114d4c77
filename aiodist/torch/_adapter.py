"""What the C++ backend calls: torch's backend operations, started on aiodist's runtime.

The C++ ``AiodistBackend`` (csrc/aiodist_backend.cpp), or the Python-only level's
``PythonProcessGroup``, calls one method of ``Adapter`` per operation, passing a fresh work
and torch's arguments (ranks are ranks within the group, timeouts in milliseconds, -1 for the
group's own). The method posts the start of aiodist's operation to the runtime loop (the same
loop thread ``aiodist.sync`` uses) and returns None, or ``(kind, message)`` for an argument
refused before anything was posted (the caller raises it as the matching torch error); an
argument aiodist refuses when the operation starts fails the work instead. When the
operation ends, a done-callback on the loop completes the work (``_finish``/``_fail``), which
wakes ``wait()`` and hands the work's future to the completer thread: nothing polls.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from typing import Any

from aiodist import work as _work
from aiodist.backends.staged import on_caller_stream
from aiodist.errors import (
    CollectiveMismatchError,
    DistError,
    DistNetworkError,
    DistStoreError,
    DistTimeoutError,
    GroupOutOfStepError,
    UnsupportedReduceError,
)
from aiodist.face import p2p as _p2p
from aiodist.face import tensor_collectives as _collectives
from aiodist.face.monitored_barrier import monitored_barrier as _monitored_barrier
from aiodist.face.sparse import sparse_all_reduce as _sparse_all_reduce
from aiodist.group import ProcessGroup
from aiodist.ops import ReduceOp
from aiodist.runtime import busy_poll as _busy_poll
from aiodist.runtime.loop_thread import LoopThread
from aiodist.runtime.origin import mark_thread
from aiodist.work import Work

__all__ = ["Adapter", "error_kind"]

# The error kinds of csrc/aiodist_backend.cpp (ErrorKind).
_DIST, _BACKEND, _NETWORK, _STORE, _VALUE, _TYPE, _RUNTIME = 1, 2, 3, 4, 5, 6, 7

Refusal = tuple[int, str] | None


def error_kind(exc: BaseException) -> tuple[int, str]:
    """The torch error class (as the C++ side's kind number) and message for ``exc``."""
    msg = str(exc) or type(exc).__name__
    if isinstance(exc, DistNetworkError):
        return _NETWORK, msg
    if isinstance(exc, DistStoreError):
        return _STORE, msg
    if isinstance(exc, DistTimeoutError):
        return _BACKEND, f"DistTimeoutError: {msg}"
    if isinstance(exc, CollectiveMismatchError):
        return _BACKEND, f"CollectiveMismatchError: {msg}"
    if isinstance(exc, GroupOutOfStepError):
        return _BACKEND, f"GroupOutOfStepError: {msg} (a torch process group: aiodist.torch.resync(group))"
    # TypeError first: an unsupported reduction (UnsupportedReduceError) is both, and torch
    # calls a wrong dtype a TypeError.
    if isinstance(exc, TypeError):
        return _TYPE, msg
    if isinstance(exc, ValueError):
        return _VALUE, msg
    if isinstance(exc, DistError):
        return _DIST, msg
    return _RUNTIME, f"{type(exc).__name__}: {msg}"


def _reduce_op(number: int) -> ReduceOp:
    try:
        return ReduceOp(number)
    except ValueError:
        name = "ReduceOp.PREMUL_SUM" if number == 8 else f"reduce op #{number}"
        raise UnsupportedReduceError(f"{name} is not supported by the aiodist backend") from None


def _timeout(ms: int) -> float | None:
    """torch's per-call timeout (milliseconds; negative: unset) as aiodist's (seconds or None)."""
    return None if ms < 0 else ms / 1000.0


class _Joined:
    """Completes one torch work when all of several aiodist Works have (coalesced calls)."""

    __slots__ = ("error", "left", "poller", "source", "work")

    def __init__(
        self, work: Any, count: int, source: Callable[[Any], int], poller: _busy_poll.BusyPoll
    ) -> None:
        self.work = work
        self.left = count
        self.error: BaseException | None = None
        self.source = source
        self.poller = poller
        poller.hold()

    def done(self, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled():
            exc: BaseException | None = DistError("the operation was cancelled")
        else:
            exc = fut.exception()
        if exc is not None and self.error is None:
            self.error = exc
        self.left -= 1
        if self.left:
            return
        self.poller.release()
        if self.error is not None:
            kind, msg = error_kind(self.error)
            self.work._fail(kind, msg)
        else:
            self.work._finish(self.source(None if fut.cancelled() else fut.result()))


def _no_source(_: Any) -> int:
    return -1


def _name_of(start: Callable[[], Work]) -> str:
    """The operation a start calls ("all_reduce"), for error messages."""
    fn = start.func if isinstance(start, functools.partial) else start
    return str(getattr(fn, "__name__", "operation"))


class Adapter:
    """torch's backend operations on one aiodist group.

    Args:
        group: the aiodist group (its ranks are global ranks of the transport it runs on).
        loop_thread: the runtime's loop thread.
        on_shutdown: called once when torch shuts the group down.
    """

    def __init__(self, group: ProcessGroup, loop_thread: LoopThread, on_shutdown: Callable[[], None]) -> None:
        self.group = group
        self._lt = loop_thread
        self._on_shutdown: Callable[[], None] | None = on_shutdown

    # -- plumbing -------------------------------------------------------------------------
    def _global(self, group_rank: int, arg: str) -> int:
        if not 0 <= group_rank < self.group.size:
            raise ValueError(f"{arg}={group_rank} is not a rank of a group of size {self.group.size}")
        return self.group.ranks[group_rank]

    def _refusal(self, what: str, exc: BaseException) -> tuple[int, str]:
        """The torch error for ``exc``, refused at the call of the operation ``what``.

        An unsupported reduction is torch's ``RuntimeError`` (what gloo raises for one), with
        aiodist's message naming the operation and the rank.
        """
        if isinstance(exc, UnsupportedReduceError):
            return _RUNTIME, f"{what} on rank {self.group.global_rank}: {exc}"
        return error_kind(exc)

    def _source(self, result: Any) -> int:
        return -1 if result is None else self.group.group_rank(int(result))

    def _start(
        self, work: Any, starts: Sequence[Callable[[], Work]], source: Callable[[Any], int] = _no_source
    ) -> Refusal:
        """Start ``starts`` on the loop; complete ``work`` when all of them have ended.

        From another thread the start is posted without waiting for it (the caller goes on to
        ``wait()`` at once: one thread hop per call instead of two); calls from one thread
        reach the loop in order, so collectives keep their order. An argument the operation
        refuses then fails the work: it is raised by ``wait()``, at the same call for
        blocking calls.
        """

        def on_loop() -> None:
            try:
                works = [fn() for fn in starts]  # a refused argument raises before anything started
            except Exception as exc:
                work._fail(*self._refusal(_name_of(starts[0]), exc))
                return
            if not works:
                work._finish(-1)
                return
            # The loop polls for a moment instead of sleeping (see aiodist.runtime.busy_poll): torch's
            # caller usually waits for the work at once (the sync face polls the same way).
            joined = _Joined(work, len(works), source, _busy_poll.for_loop(self._lt.loop))
            for w in works:
                _work.take_outcome(w).add_done_callback(joined.done)

        if self._lt.in_loop_thread():  # e.g. a future callback that starts another operation
            on_loop()
        else:
            # torch's current CUDA stream and device are per thread: CUDA tensors are staged
            # on the loop thread under the caller's (a no-op until CUDA is in use).
            mark_thread()  # (its collectives carry the calling thread's name)
            self._lt.loop.call_soon_threadsafe(on_caller_stream(on_loop))
        return None

    # -- collectives ----------------------------------------------------------------------
    def broadcast(self, work: Any, tensors: list[Any], root: int, timeout_ms: int) -> Refusal:
        g, t = self.group, _timeout(timeout_ms)
        try:
            src = self._global(root, "root")
        except ValueError as exc:
            return error_kind(exc)
        return self._start(
            work, [functools.partial(_collectives.broadcast, x, src, g, timeout=t) for x in tensors]
        )

    def allreduce(self, work: Any, tensors: list[Any], op: int, timeout_ms: int) -> Refusal:
        g, t = self.group, _timeout(timeout_ms)
        try:
            rop = _reduce_op(op)
        except ValueError as exc:
            return self._refusal("all_reduce", exc)
        return self._start(
            work, [functools.partial(_collectives.all_reduce, x, rop, g, timeout=t) for x in tensors]
        )

    def allreduce_sparse(self, work: Any, tensors: list[Any], op: int, timeout_ms: int) -> Refusal:
        """Sum sparse COO tensors as gloo does: blocking, ``work`` completed on return.

        Blocking because its steps depend on one another's results (the sizes the indices and
        values are padded to), and a step started later from a callback could take its place
        in the group's order after an operation the caller started meanwhile, differently on
        each rank. ``aiodist.sync`` runs it the same way (see ``aiodist.face.sparse``).
        """
        what = "all_reduce (sparse)"
        if self._lt.in_loop_thread():
            return (
                _RUNTIME,
                f"{what} on rank {self.group.global_rank}: called on aiodist's runtime loop thread",
            )
        if timeout_ms >= 0:
            return _VALUE, f"{what} on rank {self.group.global_rank}: a per-call timeout is not supported"
        try:
            rop = _reduce_op(op)
            if rop is not ReduceOp.SUM:  # gloo's refusal, its class
                raise UnsupportedReduceError(
                    f"sparse tensors support only ReduceOp.SUM, got ReduceOp.{rop.name}"
                )
            for x in tensors:
                _sparse_all_reduce(x, rop, self.group, False)
        except Exception as exc:
            work._fail(*self._refusal(what, exc))
            return None
        work._finish(-1)
        return None

    def reduce(self, work: Any, tensors: list[Any], root: int, op: int, timeout_ms: int) -> Refusal:
        g, t = self.group, _timeout(timeout_ms)
        try:
            rop, dst = _reduce_op(op), self._global(root, "root")
        except ValueError as exc:
            return self._refusal("reduce", exc)
        return self._start(
            work, [functools.partial(_collectives.reduce, x, dst, rop, g, timeout=t) for x in tensors]
        )

    def allgather(self, work: Any, outputs: list[list[Any]], inputs: list[Any], timeout_ms: int) -> Refusal:
        g, t = self.group, _timeout(timeout_ms)
        if len(outputs) != len(inputs):
            return _VALUE, f"allgather: {len(outputs)} output lists for {len(inputs)} inputs"
        return self._start(
            work,
            [
                functools.partial(_collectives.all_gather, o, i, g, timeout=t)
                for o, i in zip(outputs, inputs, strict=True)
            ],
        )

    def allgather_coalesced(
        self, work: Any, outputs: list[list[Any]], inputs: list[Any], timeout_ms: int
    ) -> Refusal:
        """torch's layout: ``outputs[r][i]`` receives input ``i`` of group rank ``r``."""
        g, t = self.group, _timeout(timeout_ms)
        if len(outputs) != g.size:
            return _VALUE, f"all_gather_coalesced: {len(outputs)} output lists for a group of size {g.size}"
        for r, row in enumerate(outputs):
            if len(row) != len(inputs):
                return (
                    _VALUE,
                    f"all_gather_coalesced: output list {r} has {len(row)} tensors for {len(inputs)} inputs",
                )
        return self._start(
            work,
            [
                functools.partial(_collectives.all_gather, [row[i] for row in outputs], x, g, timeout=t)
                for i, x in enumerate(inputs)
            ],
        )

    def allgather_into_tensor(
        self, work: Any, outputs: list[Any], inputs: list[Any], timeout_ms: int
    ) -> Refusal:
        g, t = self.group, _timeout(timeout_ms)
        if len(outputs) != len(inputs):
            return _VALUE, f"all_gather_into_tensor: {len(outputs)} outputs for {len(inputs)} inputs"
        return self._start(
            work,
            [
                functools.partial(_collectives.all_gather_into_tensor, o, i, g, timeout=t)
                for o, i in zip(outputs, inputs, strict=True)
            ],
        )

    def gather(
        self, work: Any, outputs: list[list[Any]], inputs: list[Any], root: int, timeout_ms: int
    ) -> Refusal:
        g, t = self.group, _timeout(timeout_ms)
        try:
            dst = self._global(root, "root")
        except ValueError as exc:
            return error_kind(exc)
        if len(inputs) != 1:
            return _VALUE, f"gather takes one input tensor, got {len(inputs)}"
        lst = outputs[0] if g.rank == root and outputs else None
        return self._start(work, [functools.partial(_collectives.gather, inputs[0], lst, dst, g, timeout=t)])

    def scatter(
        self, work: Any, outputs: list[Any], inputs: list[list[Any]], root: int, timeout_ms: int
    ) -> Refusal:
        g, t = self.group, _timeout(timeout_ms)
        try:
            src = self._global(root, "root")
        except ValueError as exc:
            return error_kind(exc)
        if len(outputs) != 1:
            return _VALUE, f"scatter takes one output tensor, got {len(outputs)}"
        lst = inputs[0] if g.rank == root and inputs else None
        return self._start(
            work, [functools.partial(_collectives.scatter, outputs[0], lst, src, g, timeout=t)]
        )

    def reduce_scatter(
        self, work: Any, outputs: list[Any], inputs: list[list[Any]], op: int, timeout_ms: int
    ) -> Refusal:
        return self._reduce_scatter(work, _collectives.reduce_scatter, outputs, inputs, op, timeout_ms)

    def reduce_scatter_tensor(
        self, work: Any, outputs: list[Any], inputs: list[Any], op: int, timeout_ms: int
    ) -> Refusal:
        return self._reduce_scatter(work, _collectives.reduce_scatter_tensor, outputs, inputs, op, timeout_ms)

    def _reduce_scatter(
        self, work: Any, run: Any, outputs: list[Any], inputs: list[Any], op: int, timeout_ms: int
    ) -> Refusal:
        """One ``run(output, input, op, group)`` per output; ``inputs[i]`` is a list or a tensor."""
        g, t = self.group, _timeout(timeout_ms)
        try:
            rop = _reduce_op(op)
        except ValueError as exc:
            return self._refusal(run.__name__, exc)
        if len(outputs) != len(inputs):
            return _VALUE, f"{run.__name__}: {len(outputs)} outputs for {len(inputs)} inputs"
        return self._start(
            work,
            [functools.partial(run, o, i, rop, g, timeout=t) for o, i in zip(outputs, inputs, strict=True)],
        )

    def alltoall_base(
        self,
        work: Any,
        output: Any,
        input: Any,
        output_splits: list[int],
        input_splits: list[int],
        timeout_ms: int,
    ) -> Refusal:
        g, t = self.group, _timeout(timeout_ms)
        fn = functools.partial(
            _collectives.all_to_all_single,
            output,
            input,
            output_splits or None,
            input_splits or None,
            g,
            timeout=t,
        )
        return self._start(work, [fn])

    def alltoall(self, work: Any, outputs: list[Any], inputs: list[Any], timeout_ms: int) -> Refusal:
        g, t = self.group, _timeout(timeout_ms)
        return self._start(work, [functools.partial(_collectives.all_to_all, outputs, inputs, g, timeout=t)])

    def barrier(self, work: Any, timeout_ms: int) -> Refusal:
        g, t = self.group, _timeout(timeout_ms)
        return self._start(work, [functools.partial(_collectives.barrier, g, timeout=t)])

    def monitored_barrier(self, timeout_ms: int, wait_all_ranks: bool) -> Refusal:
        """Blocking (torch's ``monitoredBarrier`` is): names the ranks that did not arrive."""
        g = self.group
        timeout = None if timeout_ms < 0 else timeout_ms / 1000.0
        try:
            if self._lt.in_loop_thread():
                raise DistError("monitored_barrier called on aiodist's runtime loop thread")
            # torch's wording ("Rank 2 failed to pass monitoredBarrier in 3000 ms"): torch programs match it
            self._lt.call_until_done(
                lambda: _work.take_outcome(_monitored_barrier(g, timeout, wait_all_ranks, torch_wording=True))
            )
        except Exception as exc:
            return error_kind(exc)
        return None

    def resync(self, timeout: float | None) -> Any:
        """Blocking: bring the group back in step (every member calls it); the ResyncReport."""
        if self._lt.in_loop_thread():
            raise DistError("resync called on aiodist's runtime loop thread")
        return self._lt.call_until_done(lambda: _work.take_outcome(self.group.resync(timeout)))

    # -- point-to-point -------------------------------------------------------------------
    def send(self, work: Any, tensors: list[Any], dst: int, tag: int) -> Refusal:
        g = self.group
        try:
            peer = self._global(dst, "dst")
        except ValueError as exc:
            return error_kind(exc)
        return self._start(work, [functools.partial(_p2p.isend, x, peer, g, tag) for x in tensors])

    def recv(self, work: Any, tensors: list[Any], src: int, tag: int) -> Refusal:
        g = self.group
        try:
            peer = None if src < 0 else self._global(src, "src")
        except ValueError as exc:
            return error_kind(exc)
        if len(tensors) != 1:
            return _VALUE, f"recv takes one tensor, got {len(tensors)}"
        return self._start(work, [functools.partial(_p2p.irecv, tensors[0], peer, g, tag)], self._source)

    # -- lifetime -------------------------------------------------------------------------
    def shutdown(self) -> Refusal:
        """torch destroyed the group: fail what is in flight, release what the group holds."""
        done, self._on_shutdown = self._on_shutdown, None
        if done is not None:
            try:
                done()
            except Exception as exc:
                return error_kind(exc)
        return None
