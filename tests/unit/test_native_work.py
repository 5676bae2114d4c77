"""The compiled ``Work`` and its Python twin: the same calls, the same outcomes, reports and errors.

``aiodist.work.Work`` is the compiled twin where it was built (``aiodist._work``; CI insists on
it), ``aiodist.work.PythonWork`` the reference. Each scenario runs on both and returns a trace of
everything a user sees: results, errors (type and text), ``repr``, what ``is_completed`` and
friends say, and the RuntimeWarnings and "aiodist" log records of Works dropped unseen.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest

from aiodist import native
from aiodist import work as work_module
from aiodist.errors import DistNetworkError
from tests.support.native import compiled_or_skip

pytestmark = pytest.mark.unit


def _twins() -> dict[str, Any]:
    twin = compiled_or_skip("aiodist._work")
    if native.choice() != "off":  # (the process runs the compiled engine: its Work is the twin)
        assert work_module.Work is twin.Work, "the compiled Work was built but not chosen"
    else:  # (AIODIST_NATIVE=0: not chosen, so not bound to what it shares with its twin yet)
        twin.bind(work_module._dropped, work_module.wait_future)
    return {"compiled": twin.Work, "python": work_module.PythonWork}


def _outcome(fn: Callable[[], Any]) -> Any:
    try:
        return ("ok", fn())
    except BaseException as exc:  # (CancelledError too)
        return ("raised", type(exc).__name__, str(exc))


async def _await_cases(W: Any) -> list[Any]:
    loop = asyncio.get_running_loop()
    trace: list[Any] = []

    def later(fut: asyncio.Future[Any], value: Any = None, exc: BaseException | None = None) -> None:
        loop.call_soon(lambda: fut.set_exception(exc) if exc is not None else fut.set_result(value))

    # awaited to a result, to an error
    f = loop.create_future()
    w = W(f, "recv #1")
    trace += [repr(w), w.is_completed()]
    later(f, 3)
    trace.append(await w)
    trace += [repr(w), w.is_completed(), w.is_success(), w.source_rank(), w._source_rank(), w.exception()]
    f = loop.create_future()
    w = W(f, "all_reduce #2")
    later(f, exc=DistNetworkError("rank 1 left"))
    try:
        await w
    except DistNetworkError as exc:
        trace.append(("raised", str(exc)))
    trace += [w.is_success(), str(w.exception()), _outcome(w.result)]

    # a waiter cancelled: the operation goes on, and its outcome is still there
    f = loop.create_future()
    w = W(f, "broadcast #3")

    async def waiter() -> Any:
        return await w

    task = asyncio.ensure_future(waiter())
    await asyncio.sleep(0)
    task.cancel("stop")
    trace.append(_outcome(lambda: None))
    try:
        await task
    except asyncio.CancelledError as exc:
        trace.append(("cancelled", exc.args))
    trace.append(f.cancelled())
    f.set_result(None)
    trace += [w.is_completed(), _outcome(w.result)]

    # before completion, and made done
    f = loop.create_future()
    w = W(f, "send #4")
    trace += [_outcome(w.result), w.exception(), w.is_success()]
    f.cancel()
    trace += [str(w.exception()), _outcome(w.result)]
    done = W.completed(loop, "barrier #5", 7)
    trace += [repr(done), done.result()]
    bad = W.failed(loop, "gather #6", DistNetworkError("gone"))
    trace += [str(bad.exception()), bad.get_future().exception().args]
    trace += [_outcome(W.completed(loop, "x", 1).wait), _outcome(bad.wait)]
    w = W(loop.create_future(), "scatter #7")
    trace.append(_outcome(w.wait))  # (on the loop's thread: refused)
    work_module.take_outcome(w).set_result(None)
    trace.append(work_module.future_of(w).result())
    return trace


def _dropped_cases(W: Any) -> list[str]:
    """What dropping Works unseen reports: warnings and log records, as text, in order."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        ok = loop.create_future()
        W(ok, "all_reduce #1")  # dropped pending: reported when it ends
        ok.set_result(None)
        failing = loop.create_future()
        W(failing, "recv #2")
        failing.set_exception(DistNetworkError("rank 3 left"))
        done = W.completed(loop, "barrier #3")
        done.is_completed()  # looked at: a success is not reported
        del done
        looked_failed = W.failed(loop, "send #4", DistNetworkError("refused"))
        looked_failed.is_completed()  # looked at: a failure still is
        del looked_failed
        quiet = W.failed(loop, "gather #5", DistNetworkError("x"))
        work_module.discard(quiet)
        del quiet
        await asyncio.sleep(0.01)

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage().split("\n")[0])

    handler = Keep()
    log = logging.getLogger("aiodist")
    log.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            asyncio.run(main())
            gc.collect()
    finally:
        log.removeHandler(handler)
    warned = [str(w.message).split("\n")[0] for w in caught if issubclass(w.category, RuntimeWarning)]
    return sorted(warned) + sorted(records)


def _thread_cases(W: Any) -> list[Any]:
    """``wait`` and ``get_future`` from a thread other than the loop's."""
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        trace: list[Any] = []
        f = asyncio.run_coroutine_threadsafe(_make_future(), loop).result()
        w = W(f, "all_gather #1")
        trace.append(_outcome(lambda: w.wait(0.01)))  # still running: times out
        loop.call_soon_threadsafe(f.set_result, 5)
        trace += [_outcome(w.wait), w.result(), w.get_future().result(timeout=5)]
        f = asyncio.run_coroutine_threadsafe(_make_future(), loop).result()
        w = W(f, "recv #2")
        cf = w.get_future()
        loop.call_soon_threadsafe(f.set_exception, DistNetworkError("lost"))
        trace.append(_outcome(lambda: cf.result(timeout=5)))
        trace.append(_outcome(w.wait))
        return trace
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join()
        loop.close()


async def _make_future() -> asyncio.Future[Any]:
    return asyncio.get_running_loop().create_future()


def test_awaiting_reads_alike() -> None:
    twins = _twins()
    traces = {name: asyncio.run(_await_cases(W)) for name, W in twins.items()}
    assert traces["compiled"] == traces["python"]
    assert traces["python"][2] == 3  # (the trace says something)


def test_dropping_reports_alike() -> None:
    twins = _twins()
    reports = {name: _dropped_cases(W) for name, W in twins.items()}
    assert reports["compiled"] == reports["python"]
    said = reports["python"]
    assert any("all_reduce #1 was never awaited" in r for r in said), said
    assert any("the error of recv #2 was never retrieved" in r for r in said), said
    assert any("the error of send #4 was never retrieved" in r for r in said), said
    assert not any("barrier #3" in r or "gather #5" in r for r in said), said


def test_waiting_from_a_thread_reads_alike() -> None:
    twins = _twins()
    traces = {name: _thread_cases(W) for name, W in twins.items()}
    assert traces["compiled"] == traces["python"]
    assert traces["python"][0][1] == "DistTimeoutError"
