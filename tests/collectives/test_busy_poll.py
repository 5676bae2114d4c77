"""Busy polling (``aiodist.runtime.busy_poll``): when it is on, what holds it, and that it always stops.

A poller that never stopped would burn a core for as long as the process lives; one that
leaked a hold would poll after every later operation. These tests watch the poller's own
state (``waiting``, whether its callback is scheduled) on a real event loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import numpy as np
import pytest

import aiodist as dist
from aiodist.errors import DistTimeoutError, DistValueError
from aiodist.runtime import busy_poll as _busy_poll
from aiodist.runtime import host as _host
from aiodist.runtime.loop_thread import get_loop_thread
from aiodist.settings import Settings
from aiodist.testing.memory import memory_world

pytestmark = pytest.mark.timeout(60)


# -- configuration ---------------------------------------------------------------------------


@pytest.fixture
def settings_reset() -> Iterator[None]:
    yield
    _busy_poll.configure(None)


def _budget_as_read() -> float:
    """The budget once the job's settings are applied, as ``init_process_group`` applies them."""
    Settings.read().apply()
    return _busy_poll.budget()


def test_budget_defaults_to_200us_when_every_rank_has_a_core(
    monkeypatch: pytest.MonkeyPatch, settings_reset: None
) -> None:
    monkeypatch.delenv("AIODIST_BUSY_POLL_US", raising=False)
    monkeypatch.setattr(_host, "has_core_per_rank", lambda: True)
    assert _budget_as_read() == pytest.approx(200e-6)


def test_budget_defaults_to_off_on_an_oversubscribed_host(
    monkeypatch: pytest.MonkeyPatch, settings_reset: None
) -> None:
    """Polling there would take the core another rank needs."""
    monkeypatch.delenv("AIODIST_BUSY_POLL_US", raising=False)
    monkeypatch.setattr(_host, "has_core_per_rank", lambda: False)
    assert _budget_as_read() == 0.0


@pytest.mark.parametrize(
    ("raw", "seconds"), [("50", 50e-6), ("0", 0.0), (" 1000.5 ", 1000.5e-6), ("-3", 0.0)]
)
def test_budget_from_the_variable(
    monkeypatch: pytest.MonkeyPatch, settings_reset: None, raw: str, seconds: float
) -> None:
    monkeypatch.setattr(_host, "has_core_per_rank", lambda: False)  # an explicit value wins
    monkeypatch.setenv("AIODIST_BUSY_POLL_US", raw)
    assert _budget_as_read() == pytest.approx(seconds)


def test_bad_budget_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIODIST_BUSY_POLL_US", "lots")
    with pytest.raises(DistValueError, match=r"AIODIST_BUSY_POLL_US.*'lots'"):
        Settings.read()


def test_host_counts_ranks_from_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert Settings.read().ranks_on_host == 3  # the ranks of this host, not of the job
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert Settings.read().ranks_on_host == 8
    monkeypatch.setenv("WORLD_SIZE", "x")
    assert Settings.read().ranks_on_host == 1


# -- the poller on a loop ----------------------------------------------------------------------


async def test_polls_while_held_and_a_budget_after_the_last_release() -> None:
    """Operations of an async program come one after another: the loop keeps polling for one
    budget after the last one ends, so that the next one's messages need no doorbell; then it
    sleeps."""
    poller = _busy_poll.BusyPoll(asyncio.get_running_loop(), budget=0.05)
    poller.hold()
    for _ in range(5):
        await asyncio.sleep(0)
        assert poller._handle is not None, "the poller stopped while something still waits"
    poller.release()
    await asyncio.sleep(0)
    assert poller._handle is not None and poller.waiting == 0
    await asyncio.sleep(0.2)
    assert poller._handle is None and poller.waiting == 0


async def test_a_blocked_callers_poller_stops_on_release() -> None:
    """The sync face's loop thread: its caller computes once its call returns (the GIL is shared)."""
    poller = _busy_poll.BusyPoll(asyncio.get_running_loop(), budget=10.0, for_ops=False)
    poller.hold()
    await asyncio.sleep(0)
    assert poller._handle is not None
    poller.release()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert poller._handle is None and poller.waiting == 0


class _Source:
    """A poll source that reports progress on the turns it is told to."""

    def __init__(self) -> None:
        self.moving = True
        self.polling: list[bool] = []

    def poll(self) -> bool:
        return self.moving

    def set_polling(self, polling: bool) -> None:
        self.polling.append(polling)


async def test_progress_renews_the_budget_and_stopping_is_announced() -> None:
    """While messages keep moving (a long operation's pieces) the budget starts again; once
    nothing moves for a budget the loop sleeps, and the sources hear it (writers ring again)."""
    poller = _busy_poll.BusyPoll(asyncio.get_running_loop(), budget=0.02, for_ops=False)
    source = _Source()
    poller.add_source(source)
    poller.hold()
    await asyncio.sleep(0.1)  # five budgets, with progress on every turn
    assert poller._handle is not None
    source.moving = False
    await asyncio.sleep(0.2)
    assert poller._handle is None and poller.waiting == 1
    assert source.polling == [True, False]
    poller.release()


async def test_stops_when_the_budget_runs_out_even_if_still_held() -> None:
    """A slow peer costs at most the budget in CPU: then the loop sleeps as usual."""
    poller = _busy_poll.BusyPoll(asyncio.get_running_loop(), budget=0.005)
    poller.hold()
    await asyncio.sleep(0.05)
    assert poller._handle is None
    assert poller.waiting == 1
    poller.hold()  # a new wait buys a new budget
    await asyncio.sleep(0)
    assert poller._handle is not None
    poller.release()
    poller.release()
    await asyncio.sleep(0.01)
    assert poller._handle is None and poller.waiting == 0


async def test_zero_budget_never_polls() -> None:
    poller = _busy_poll.BusyPoll(asyncio.get_running_loop(), budget=0.0)
    poller.hold()
    await asyncio.sleep(0)
    assert poller._handle is None
    poller.release()


# -- who holds it ----------------------------------------------------------------------------


async def test_operations_hold_the_poller_until_they_end() -> None:
    """Completed, failed and timed-out operations all give their hold back."""
    loop = asyncio.get_running_loop()
    poller = _busy_poll.for_loop(loop)
    assert poller.for_ops
    base = poller.waiting
    fabric, (g0, g1) = memory_world(2, timeout=5.0)
    try:
        buf = np.zeros(4, np.float32)
        pending = g1.recv(buf, 0)
        assert poller.waiting == base + 1
        await g0.send(np.arange(4, dtype=np.float32), 1)
        assert await pending == 0
        await asyncio.sleep(0)  # holds are given back by the future's done-callbacks
        assert poller.waiting == base

        late = g1.recv(np.zeros(1, np.float32), 0, timeout=0.05)
        with pytest.raises(DistTimeoutError):
            await late
        await asyncio.sleep(0)
        assert poller.waiting == base

        works = [dist.all_reduce(np.ones(3, np.float32), group=g) for g in (g0, g1)]
        await asyncio.gather(*works)
        await asyncio.sleep(0)
        assert poller.waiting == base
    finally:
        for t in fabric.transports:
            t.abort()


def test_sync_face_polls_only_while_a_caller_blocks() -> None:
    """The loop thread's poller is not held by operations (the caller may be computing), but
    is held for exactly as long as a blocking call waits."""
    lt = get_loop_thread()
    poller = _busy_poll.for_loop(lt.loop)
    assert not poller.for_ops
    gate: asyncio.Future[int] = lt.call(lt.loop.create_future)
    seen: list[int] = []
    caller = threading.Thread(target=lambda: seen.append(lt.wait_future(gate)[1]))  # type: ignore[arg-type]
    caller.start()
    for _ in range(200):
        if lt.call(lambda: poller.waiting) == 1:
            break
        threading.Event().wait(0.005)
    assert lt.call(lambda: poller.waiting) == 1, "a blocked caller should hold the poller"
    lt.loop.call_soon_threadsafe(gate.set_result, 7)
    caller.join(5)
    assert seen == [7]
    assert lt.call(lambda: poller.waiting) == 0


async def test_bad_budget_fails_init_before_the_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIODIST_BUSY_POLL_US", "fast")
    # Nothing listens at this address: reaching the rendezvous would hang until its timeout.
    with pytest.raises(DistValueError, match="AIODIST_BUSY_POLL_US"):
        await dist.init_process_group("tcp", "tcp://127.0.0.1:9", rank=0, world_size=2, timeout=30)
    assert not dist.is_initialized()
