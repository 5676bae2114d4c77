"""What a rank knows of its host and machine: whether each rank has a core (busy polling and
worker threads depend on it), counting the ranks of every host of the machine."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from aiodist.runtime import busy_poll, host
from aiodist.settings import Settings


@pytest.fixture(autouse=True)
def _fresh_counts(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("AIODIST_BUSY_POLL_US", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    Settings.read().apply()
    yield
    host.note_ranks_on_machine(0)
    busy_poll.configure(None)


def test_ranks_of_other_hosts_of_the_machine_count_against_its_cores() -> None:
    machine = os.cpu_count() or 1
    host.note_ranks_on_machine(machine)
    assert host.has_core_per_rank() == (host.cores() >= 1)
    assert busy_poll.budget() > 0
    # One rank per host, but more hosts of this machine than it has cores (network namespaces
    # or containers of one kernel): the ranks would poll on each other's cores.
    host.note_ranks_on_machine(machine + 1)
    assert not host.has_core_per_rank() and not host.has_spare_core()
    assert busy_poll.budget() == 0.0


def test_an_explicit_poll_budget_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    host.note_ranks_on_machine((os.cpu_count() or 1) + 1)
    monkeypatch.setenv("AIODIST_BUSY_POLL_US", "50")
    Settings.read().apply()
    assert busy_poll.budget() == pytest.approx(50e-6)


def test_the_machine_is_the_kernel_whatever_the_host_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIODIST_HOST_ID", raising=False)
    Settings.read().apply()
    boot = host.machine_id()
    assert boot and boot in host.host_id()  # (no AIODIST_HOST_ID here)
