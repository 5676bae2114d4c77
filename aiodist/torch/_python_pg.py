"""The Python-only level: a ``torch.distributed.ProcessGroup`` subclass, for machines that cannot
build the C++ extension (no compiler), or when ``AIODIST_TORCH_BACKEND=python`` asks for it.

torch's frontend calls a Python subclass's methods directly, and torch's C++ code (DDP's
Reducer, functional collectives) reaches them through torch's ``PyProcessGroup`` trampoline,
so collectives, point-to-point calls, object collectives, barriers, subgroups,
``DistributedSampler``, torch's DistributedDataParallel, functional collectives, DeviceMesh/
DTensor and FSDP2 work. Two things make the last three work: the group answers
``group_name`` with the name torch gave it (torch keeps a group's name on its C++ backends,
and this group has none; functional collectives find the group by it), and it implements the
coalesced all_gather/reduce_scatter methods, through which torch's C++ runs
``all_gather_into_tensor`` and ``reduce_scatter_tensor`` on a Python group. What asks the
group for a per-device C++ backend (``pg._get_backend(device)``) does not work. The
operations are the same ``Adapter`` methods the C++ backend calls.
"""

from __future__ import annotations

import contextlib
import datetime
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as td

from aiodist.torch._adapter import Adapter

__all__ = ["PythonProcessGroup"]

_KIND_ERRORS: dict[int, Callable[[str], BaseException]] = {
    1: td.DistError,
    2: td.DistBackendError,
    3: td.DistNetworkError,
    4: td.DistStoreError,
    5: ValueError,
    6: TypeError,
}


def _error(kind: int, msg: str) -> BaseException:
    return _KIND_ERRORS.get(kind, RuntimeError)(msg)


class _Completer:
    """Completes futures in order, off aiodist's loop (see csrc/aiodist_backend.cpp's Completer)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="aiodist-torch-completer", daemon=True)
        self._thread.start()

    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def post(self, fn: Callable[[], None]) -> None:
        self._queue.put(fn)

    def _run(self) -> None:
        while True:
            fn = self._queue.get()
            with contextlib.suppress(Exception):  # a future reports callback errors to its chained futures
                fn()


_completer_lock = threading.Lock()
_completer: _Completer | None = None


def _get_completer() -> _Completer:
    global _completer
    with _completer_lock:
        if _completer is None:
            _completer = _Completer()
        return _completer


# torch's classes as untyped bases: the subclasses take torch's frontend calls, whose overloads
# in torch's stubs differ from version to version.
_WorkBase: Any = td.Work
_ProcessGroupBase: Any = td.ProcessGroup


class _Work(_WorkBase):  # type: ignore[misc]
    """torch's ``Work`` for one operation; completed from aiodist's loop by ``_finish``/``_fail``."""

    def __init__(self, outputs: list[Any]) -> None:
        super().__init__()
        self._outputs = outputs
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._source = -1
        self._future: Any = torch.futures.Future()
        self._inline = _get_completer().on_thread()

    def _complete(self, fn: Callable[[], None]) -> None:
        if self._inline:
            fn()
        else:
            _get_completer().post(fn)

    def _finish(self, source_rank: int = -1) -> None:
        self._source = source_rank
        self._done.set()
        self._complete(lambda: self._future.set_result(self._outputs))

    def _fail(self, kind: int, msg: str) -> None:
        self._error = _error(kind, msg)
        self._done.set()
        self._complete(lambda: self._future.set_exception(self._error))

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        seconds = None if timeout is None or timeout.total_seconds() <= 0 else timeout.total_seconds()
        if not self._done.wait(seconds):
            raise td.DistBackendError(f"the operation did not complete within {seconds} s")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def get_future(self) -> Any:
        return self._future

    def _source_rank(self) -> int:
        return self._source

    def source_rank(self) -> int:
        return self._source

    def result(self) -> list[Any]:
        return self._outputs


def _ms(timeout: datetime.timedelta) -> int:
    return int(timeout.total_seconds() * 1000) if timeout.total_seconds() >= 0 else -1


def _op(opts: Any) -> int:
    return int(opts.reduceOp.op)


class PythonProcessGroup(_ProcessGroupBase):  # type: ignore[misc]
    """A torch process group whose operations run on aiodist's runtime (``Adapter``).

    Args:
        group_name: the name torch gave the group (``group_name``; see the module doc).
    """

    def __init__(self, rank: int, size: int, adapter: Adapter, group_name: str) -> None:
        super().__init__(rank, size)
        self._adapter = adapter
        self._group_name = group_name

    def _run(self, outputs: list[Any], start: Callable[[_Work], Any]) -> _Work:
        work = _Work(outputs)
        refusal = start(work)
        if refusal is not None:
            raise _error(*refusal)
        return work

    @property
    def aiodist_group(self) -> Any:
        """The aiodist group it runs on: what ``aiodist.sync`` uses when given this one."""
        return self._adapter.group

    def getBackendName(self) -> str:
        return "aiodist"

    @property
    def name(self) -> str:
        return "aiodist"

    @property
    def group_name(self) -> str:
        return self._group_name

    def allreduce(self, tensors: list[Any], opts: Any = None) -> _Work:
        opts = opts if opts is not None else td.AllreduceOptions()
        if any(t.layout is torch.sparse_coo for t in tensors):  # torch's C++ would call allreduce_sparse
            return self._run(
                tensors, lambda w: self._adapter.allreduce_sparse(w, tensors, _op(opts), _ms(opts.timeout))
            )
        return self._run(tensors, lambda w: self._adapter.allreduce(w, tensors, _op(opts), _ms(opts.timeout)))

    def broadcast(self, tensors: list[Any], opts: Any = None) -> _Work:
        opts = opts if opts is not None else td.BroadcastOptions()
        return self._run(
            tensors, lambda w: self._adapter.broadcast(w, tensors, opts.rootRank, _ms(opts.timeout))
        )

    def reduce(self, tensors: list[Any], opts: Any) -> _Work:
        return self._run(
            tensors, lambda w: self._adapter.reduce(w, tensors, opts.rootRank, _op(opts), _ms(opts.timeout))
        )

    def allgather(self, outputs: list[list[Any]], inputs: list[Any], opts: Any = None) -> _Work:
        t = _ms(opts.timeout) if opts is not None else -1
        return self._run(
            [x for o in outputs for x in o], lambda w: self._adapter.allgather(w, outputs, inputs, t)
        )

    def allgather_coalesced(self, outputs: list[list[Any]], inputs: list[Any], opts: Any = None) -> _Work:
        t = _ms(opts.timeout) if opts is not None else -1
        return self._run(
            [x for o in outputs for x in o],
            lambda w: self._adapter.allgather_coalesced(w, outputs, inputs, t),
        )

    def all_gather_single(self, output: Any, input: Any, opts: Any = None) -> _Work:
        t = _ms(opts.timeout) if opts is not None else -1
        return self._run([output], lambda w: self._adapter.allgather_into_tensor(w, [output], [input], t))

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[Any], inputs: list[Any], opts: Any = None) -> _Work:
        t = _ms(opts.timeout) if opts is not None else -1
        return self._run(outputs, lambda w: self._adapter.allgather_into_tensor(w, outputs, inputs, t))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allreduce_coalesced(self, tensors: list[Any], opts: Any = None) -> _Work:
        opts = opts if opts is not None else td.AllreduceCoalescedOptions()
        return self._run(tensors, lambda w: self._adapter.allreduce(w, tensors, _op(opts), _ms(opts.timeout)))

    def gather(self, outputs: list[list[Any]], inputs: list[Any], opts: Any) -> _Work:
        return self._run(
            [x for o in outputs for x in o],
            lambda w: self._adapter.gather(w, outputs, inputs, opts.rootRank, _ms(opts.timeout)),
        )

    def scatter(self, outputs: list[Any], inputs: list[list[Any]], opts: Any) -> _Work:
        return self._run(
            outputs, lambda w: self._adapter.scatter(w, outputs, inputs, opts.rootRank, _ms(opts.timeout))
        )

    def reduce_scatter(self, outputs: list[Any], inputs: list[list[Any]], opts: Any) -> _Work:
        return self._run(
            outputs, lambda w: self._adapter.reduce_scatter(w, outputs, inputs, _op(opts), _ms(opts.timeout))
        )

    def reduce_scatter_single(self, output: Any, input: Any, opts: Any) -> _Work:
        return self._run(
            [output],
            lambda w: self._adapter.reduce_scatter_tensor(w, [output], [input], _op(opts), _ms(opts.timeout)),
        )

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[Any], inputs: list[Any], opts: Any) -> _Work:
        return self._run(
            outputs,
            lambda w: self._adapter.reduce_scatter_tensor(w, outputs, inputs, _op(opts), _ms(opts.timeout)),
        )

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(
        self, output: Any, input: Any, output_splits: list[int], input_splits: list[int], opts: Any
    ) -> _Work:
        return self._run(
            [output],
            lambda w: self._adapter.alltoall_base(
                w, output, input, list(output_splits), list(input_splits), _ms(opts.timeout)
            ),
        )

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: list[Any], inputs: list[Any], opts: Any) -> _Work:
        return self._run(outputs, lambda w: self._adapter.alltoall(w, outputs, inputs, _ms(opts.timeout)))

    def barrier(self, opts: Any = None) -> _Work:
        t = _ms(opts.timeout) if opts is not None else -1
        return self._run([], lambda w: self._adapter.barrier(w, t))

    def monitored_barrier(
        self, timeout: datetime.timedelta | None = None, wait_all_ranks: bool = False
    ) -> None:
        refusal = self._adapter.monitored_barrier(-1 if timeout is None else _ms(timeout), wait_all_ranks)
        if refusal is not None:
            raise _error(*refusal)

    def send(self, tensors: list[Any], dst: int, tag: int = 0) -> _Work:
        return self._run(tensors, lambda w: self._adapter.send(w, tensors, dst, tag))

    def recv(self, tensors: list[Any], src: int, tag: int = 0) -> _Work:
        return self._run(tensors, lambda w: self._adapter.recv(w, tensors, src, tag))

    def recv_anysource(self, tensors: list[Any], tag: int = 0) -> _Work:
        return self._run(tensors, lambda w: self._adapter.recv(w, tensors, -1, tag))

    def shutdown(self) -> None:
        refusal = self._adapter.shutdown()
        if refusal is not None:
            raise _error(*refusal)

    def abort(self) -> None:
        self.shutdown()
