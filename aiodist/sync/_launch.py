"""How the blocking face starts a tensor operation: the common path, and the slow path for
torch's profiler and for non-contiguous tensors.

``run_op(name, start, async_op, *tensors)`` calls ``start(*tensors)`` (which returns a Work) on
the loop thread, as ``_bridge.call`` does. Two things take the slow path:

- torch's profiler is recording (torch imported and a profiler active; one module lookup to
  find out): the operation is recorded as torch's backends name it, ``"gloo:all_reduce"``, with
  its input tensors (for ``record_shapes``). The record opens in the caller's thread and closes
  on the loop thread when the operation completes, so it is asynchronous, as gloo's are.
- a tensor is not contiguous (the tensor layer refuses it with ``NotContiguousError`` before
  the operation takes a sequence number): the operation runs on contiguous copies, which are
  written back into the caller's tensors before the Work completes, as gloo does.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from aiodist import _tensors
from aiodist import work as _work
from aiodist._tensors import NotContiguousError
from aiodist.face.world import resolve_group
from aiodist.operations import operation_named
from aiodist.sync import _job_backend
from aiodist.sync._bridge import call, collective_here
from aiodist.work import Work

__all__ = ["begin_record", "end_record", "profiling", "run_entry", "run_op"]


# The records opened while a profiler runs. torch reads a record's end thread (what makes it
# "async") when the profiler stops, and loses it if the record object is gone by then: they are
# kept until the first operation after the profiler stopped.
_kept: list[Any] = []


def profiling() -> bool:
    """True while torch's profiler (``torch.profiler`` or ``torch.autograd.profiler``) records."""
    profiler = sys.modules.get("torch.autograd.profiler")
    if profiler is not None and getattr(profiler, "_is_profiler_enabled", False):
        return True
    if _kept:
        _kept.clear()
    return False


def begin_record(name: str, tensors: Sequence[Any]) -> Any:
    """Open the profiler's record ``name`` (e.g. "gloo:send") with the torch tensors among ``tensors``."""
    torch = sys.modules["torch"]
    # As gloo records them: complex tensors as their real view (shape [..., 2]).
    inputs = [
        torch.view_as_real(t) if t.is_complex() else t for t in _flat(tensors) if isinstance(t, torch.Tensor)
    ]
    fast = getattr(getattr(torch._C, "_profiler", None), "_RecordFunctionFast", None)
    record = fast(name, inputs) if fast is not None else torch.autograd.profiler.record_function(name)
    record.__enter__()
    _kept.append(record)
    return record


def end_record(record: Any) -> None:
    record.__exit__(None, None, None)


def _flat(tensors: Sequence[Any]) -> list[Any]:
    out: list[Any] = []
    for t in tensors:
        if isinstance(t, list | tuple):
            out.extend(t)
        elif t is not None:
            out.append(t)
    return out


def run_op(
    name: str, start: Callable[..., Work], async_op: bool, *tensors: Any, inputs: int | None = None
) -> Any:
    """``start(*tensors)`` on the loop; block for it unless ``async_op`` (then return its Work).

    Args:
        name: the name gloo's profiler record has ("all_reduce" for "gloo:all_reduce").
        start: starts the operation on the given tensors (tensor lists allowed) and returns its Work.
        inputs: the position among ``tensors`` of the operation's input, which the profiler's
            record shows as gloo's does (None: every tensor).
    """
    if profiling():
        shown = tensors if inputs is None else tensors[inputs : inputs + 1]
        return _run_slow(name, start, async_op, tensors, record=shown)
    try:
        return call(lambda: start(*tensors), async_op)
    except NotContiguousError:
        pass  # refused before it started: run it on contiguous copies
    return _run_slow(name, start, async_op, tensors, record=None)


def run_entry(name: str, group: Any, async_op: bool, *args: Any, timeout: float | None = None) -> Work | None:
    """``run_op`` for the operation table's entry ``name`` (``aiodist.operations``) on ``group``,
    with the async face's arguments between ``group`` and ``timeout``: its leading tensor
    arguments are those a non-contiguous tensor is copied for, and the profiler's record is
    named and shows the input as the entry says (as gloo's)."""
    if not async_op and not profiling() and collective_here(name, group, args, timeout):
        return None  # (on this thread: a small collective of a group on this host)
    entry = operation_named(name)
    n = entry.tensors
    rest = args[n:]

    def start(*tensors: Any) -> Work:
        return resolve_group(group).collective(name, *tensors, *rest, timeout=timeout)

    return run_op(entry.record, start, async_op, *args[:n], inputs=entry.shown)  # type: ignore[no-any-return]


def _run_slow(
    name: str, start: Callable[..., Work], async_op: bool, tensors: tuple[Any, ...], *, record: Any
) -> Any:
    """``record``: the tensors to show in a profiler record (None: no record)."""
    copies: list[tuple[Any, Any]] = []  # (the caller's tensor, its contiguous copy)

    def contiguous(obj: Any) -> Any:
        if isinstance(obj, list | tuple):
            return type(obj)(contiguous(o) for o in obj)
        copy = _contiguous_copy(obj)
        if copy is obj:
            return obj
        copies.append((obj, copy))
        return copy

    args = [contiguous(t) for t in tensors]
    rec = begin_record(f"{_backend()}:{name}", record) if record is not None else None

    def begin() -> Work:
        try:
            inner = start(*args)
        except BaseException:
            if rec is not None:
                end_record(rec)
            raise
        work = inner
        if copies:
            work = Work(asyncio.get_running_loop().create_task(_write_back(inner, copies)), inner.name)
        if rec is not None:
            # Closed here, on the loop thread, before the caller can wake: at once when the
            # operation is already done, else by a callback registered ahead of the caller's.
            fut = _work.future_of(work)
            if fut.done():
                end_record(rec)
            else:
                fut.add_done_callback(lambda _: end_record(rec))
        return work

    return call(begin, async_op)


async def _write_back(inner: Work, copies: list[tuple[Any, Any]]) -> Any:
    result = await inner
    for user, copy in copies:
        if isinstance(user, np.ndarray):
            if user.flags.writeable:
                np.copyto(user, copy)
        else:
            user.detach().copy_(copy)
    return result


def _contiguous_copy(obj: Any) -> Any:
    """A contiguous copy of a non-contiguous array or CPU tensor; anything else itself."""
    if isinstance(obj, np.ndarray):
        return obj if obj.flags.c_contiguous else np.ascontiguousarray(obj)
    if _tensors.is_torch_tensor(obj) and obj.layout is sys.modules["torch"].strided:
        return obj if obj.is_contiguous() else obj.detach().contiguous()
    return obj


def _backend() -> str:
    try:
        return _job_backend.name_of()
    except Exception:  # no default group: the operation will say so itself
        return "gloo"
