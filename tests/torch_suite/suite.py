"""torch's distributed test suite as upstream's ``test_distributed_spawn.py`` runs it.

Imported by the driver and by every rank process it starts (``spawn`` re-imports it there),
so the swap below happens in each of them. The environment decides:

- ``BACKEND`` (gloo, or aiodist for the backend variant), ``WORLD_SIZE``, ``INIT_METHOD``
  (file:// or env://): read by torch's module at import time, as upstream;
- ``AIODIST_TORCH_SUITE``: "gloo" leaves torch's own; "facade" swaps the module's ``dist``
  (and the names it imported from ``torch.distributed``) for ``aiodist.sync``; "backend"
  leaves the module as it is and registers the backend "aiodist" (``import aiodist.torch``), so
  that with BACKEND=aiodist every group the suite creates is on aiodist;
- ``AIODIST_TORCH_SUITE_START``: "spawn" (upstream's) or "fork" (no torch import per rank).
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.gettempdir())

import torch
import torch.testing._internal.common_distributed as common_distributed
from torch.testing._internal.common_distributed import DistTestCases, MultiProcessTestCase

VARIANT = os.environ.get("AIODIST_TORCH_SUITE", "gloo")
START_METHOD = os.environ.get("AIODIST_TORCH_SUITE_START", "spawn")
VARIANTS = ("gloo", "facade", "backend")
if VARIANT not in VARIANTS:
    raise SystemExit(f"AIODIST_TORCH_SUITE must be one of {', '.join(VARIANTS)}, not {VARIANT!r}")

# What the backend variant declares about "aiodist" through the suite's own table of backend
# features, which its decorators read when the module is imported (so: before the import).
# "plugin": a backend registered from outside torch is available; "ddp": torch's DDP runs on
# it; "subgroup": new_group(...) works; "gpu"/"cuda": it takes CUDA tensors (staged through
# pinned host memory wherever torch has CUDA; the suite's GPU tests also ask for GPUs, so they
# skip on a machine without, and the CPU tests it gates on "gpu" run, as for gloo). Nothing in
# ``skip_collective`` (aiodist lacks none of those).
DECLARED_FEATURES = ("plugin", "ddp", "subgroup", "gpu", "cuda")

if VARIANT == "backend":
    if os.environ["BACKEND"] != "aiodist":
        raise SystemExit("the backend variant runs with BACKEND=aiodist")
    import aiodist.torch

    aiodist.torch.build()  # once here: forked ranks inherit the loaded extension
    for feature in DECLARED_FEATURES:
        DistTestCases.backend_feature[feature].add(aiodist.torch.BACKEND_NAME)

import torch.testing._internal.distributed.distributed_test as dt  # noqa: E402

if VARIANT == "facade":
    import aiodist.sync

    # The suite calls ``dist.<name>`` throughout; it also imported ``get_world_size`` by name.
    # Everything else it took from torch.distributed by name reaches into torch's internals
    # (``_get_default_group``, ``_get_pg_config``) and stays torch's: those tests are exempt.
    dt.dist = aiodist.sync  # type: ignore[assignment]
    dt.get_world_size = aiodist.sync.get_world_size

    class _Prefer:
        """A module stand-in: ``aiodist.sync``'s names where it has them, torch.distributed's otherwise."""

        def __getattr__(self, name: str) -> object:
            return getattr(aiodist.sync if hasattr(aiodist.sync, name) else torch.distributed, name)

    # The harness (e.g. ``with_dist_debug_levels``: set the level, run, then ``c10d.barrier()``)
    # calls torch.distributed as ``c10d``; on aiodist it must reach the runtime the test uses.
    common_distributed.c10d = _Prefer()  # type: ignore[assignment]


class TestDistBackendWithSpawn(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
    """upstream's class of the same name: one process per rank for every test."""

    def setUp(self) -> None:
        super().setUp()  # a fresh TEMP_DIR and INIT_METHOD (a file:// rendezvous) for this test
        # Spawned ranks re-import torch's module and read INIT_METHOD anew; forked ones inherit
        # the module as imported here, so hand them this test's value as spawn would.
        dt.INIT_METHOD = os.environ["INIT_METHOD"]
        if START_METHOD == "fork":
            MultiProcessTestCase._start_processes(self, torch.multiprocessing.get_context("fork").Process)
        else:
            self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()
