"""The ``hosts`` tier's fixtures: beds of network namespaces, removed whatever happens.

The whole tier is skipped, saying why, where no bed can be made (not root, no ``ip``,
``unshare`` or ``tc``, or the kernel refuses network namespaces).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from hosts.netbed import Bed, BedError, Shaping, unavailable

MakeBed = Callable[..., Bed]


@pytest.fixture(scope="session")
def _beds_possible() -> None:
    why = unavailable()
    if why is not None:
        pytest.skip(f"no multi-host bed here: {why}")


@pytest.fixture
def make_bed(_beds_possible: None) -> Iterator[MakeBed]:
    """``make_bed(n_hosts, shaping=None)``: a bed of the test's own, destroyed (its processes
    SIGKILLed) when the test ends, passed, failed or timed out; a bed a killed test run left
    behind is swept by the next one (``netbed.sweep``)."""
    beds: list[Bed] = []

    def make(n_hosts: int, shaping: Shaping | None = None) -> Bed:
        bed = Bed.create(n_hosts, shaping=shaping)
        beds.append(bed)
        return bed

    try:
        yield make
    finally:
        problems = []
        for bed in beds:
            try:
                bed.destroy()
            except BedError as exc:
                problems.append(str(exc))
        assert not problems, problems
