"""The test tiers, by folder: each test is marked with its folder's tier.

- ``unit``: pure code (wire formats, reduce ops, bucketing, fingerprints, tensors); no sockets.
- ``collectives``: every algorithm, ranks as tasks over the in-memory transport.
- ``integration``: real processes over loopback TCP (init, both faces, launcher, DDP, examples,
  torch's engines and backend, bench).
- ``faults``: the failure cases (dead, stopped and hostile peers, timeouts, lost connections).
- ``hosts``: real multi-host jobs, each host a network namespace of a bed (``hosts/netbed.py``):
  every operation, the host-aware forms, killed hosts and cut links; skipped, saying why,
  where no namespace can be made (not root, no ``ip``).

A test may name its tier itself, as the memory cases of ``integration/test_every_operation.py``
do (``collectives``) and the comparisons with torch's DDP Reducer in ``unit/test_bucketing.py``
(``integration``: they run torch's DDP in a child process). ``make test-fast`` runs the first
two (``-m "unit or collectives"``); ``make test-hosts`` the last; ``make test`` runs all.
The shared helpers are the ``support`` package beside this file (``tests/`` is on ``sys.path``,
as pytest puts a rootless conftest's folder there).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aiodist import settings
from aiodist.runtime import busy_poll
from aiodist.transport import shm_segment

TIERS = ("unit", "collectives", "integration", "faults", "hosts")
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        try:
            tier = Path(str(item.path)).resolve().relative_to(HERE).parts[0]
        except ValueError:
            continue
        # A test may name its tier itself (the memory cases of the every-operation suite).
        if tier in TIERS and not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(getattr(pytest.mark, tier))


def _segments() -> set[str]:
    try:
        return {n for n in os.listdir(shm_segment.SEGMENT_DIR) if n.startswith(shm_segment.PREFIX)}
    except OSError:
        return set()


@pytest.fixture(autouse=True)
def _process_settings_as_the_environment_says() -> Iterator[None]:
    """What a test applied process-wide (the debug level, the busy-poll budget: set by each init
    from the environment) ends with it, as its environment does."""
    yield
    try:
        read = settings.Settings.read()
    except ValueError:  # a variable the test left behind: not this fixture's business
        read = settings.Settings()
    settings.set_debug_level(read.debug, export=False)
    busy_poll.configure(read.busy_poll_us)


@pytest.fixture(autouse=True)
def _no_segment_left() -> Iterator[None]:
    """No test leaves a shared-memory segment of aiodist in /dev/shm (its ranks unlink them as
    soon as both ends map them; the launchers sweep what a killed rank leaves)."""
    before = _segments()
    yield
    deadline = time.monotonic() + 5.0  # processes of the test may still be exiting
    while (left := _segments() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"shared-memory segments left in {shm_segment.SEGMENT_DIR}: {sorted(left)}"
