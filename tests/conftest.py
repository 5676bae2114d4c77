"""The test tiers, by folder: each test is marked with its folder's tier.

- ``unit``: pure code (wire formats, reduce ops, bucketing, fingerprints, tensors); no sockets.
- ``collectives``: every algorithm, ranks as tasks over the in-memory transport.
- ``integration``: real processes over loopback TCP (init, both faces, launcher, DDP, examples,
  torch's engines and backend, bench).
- ``faults``: the failure cases (dead, stopped and hostile peers, timeouts, lost connections).

A test may name its tier itself, as the memory cases of ``integration/test_every_operation.py``
do (``collectives``). ``make test-fast`` runs the first two (``-m "unit or collectives"``);
``make test`` runs all.
The shared helpers are the ``support`` package beside this file (``tests/`` is on ``sys.path``,
as pytest puts a rootless conftest's folder there).
"""

from __future__ import annotations

from pathlib import Path

import pytest

TIERS = ("unit", "collectives", "integration", "faults")
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
