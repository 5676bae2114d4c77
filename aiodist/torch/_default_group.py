"""torch.distributed's default group for a job of the sync face, on aiodist's connections.

torch's helpers ask ``torch.distributed``, not ``aiodist.sync``, for the rank and the world size
(``DistributedSampler``), and run their collectives through it (``SyncBatchNorm``, torch's
``DistributedDataParallel``, ``torch.distributed.checkpoint``). So ``aiodist.sync``'s init, in a
program that uses torch, also initialises ``torch.distributed``'s default group, on the
"aiodist" backend, over the connections its own rendezvous just made (handed over as ``LentJob``): no
second rendezvous, no second connection between ranks. It is a group of its own on them (its
operations are numbered apart from the sync face's, so calls through either face may come in
any order between the two), on the backend's Python-only level unless ``AIODIST_TORCH_BACKEND=cpp``
(that level needs no build). ``aiodist.sync.destroy_process_group`` destroys it first.
"""

from __future__ import annotations

import datetime
import sys
from typing import Any

import torch.distributed as _td

from aiodist.backends.torch_engine import torch_store
from aiodist.face.world import world
from aiodist.store import PrefixStore
from aiodist.torch._backend import BACKEND_NAME, LentJob

__all__ = ["initialise", "owns_default_group", "release"]

# The store torch was given, kept alive with the group: torch holds only the C++ half of a
# store written in Python, whose methods fail once the Python object is collected.
_stores: dict[int, Any] = {}


def initialise() -> Any:
    """Initialise torch's default group over the sync face's job; returns it (see ``release``).

    Call it on the sync face's calling thread (not the runtime loop's), right after its init.

    Raises:
        DistValueError: torch's default group already exists.
        What torch's ``init_process_group`` raises (e.g. ``AIODIST_TORCH_BACKEND=cpp`` where the
        C++ extension cannot be built).
    """
    w = world()
    assert w.job_store is not None  # set by every init
    # torch hands later groups (e.g. a gloo group from torch.distributed.new_group) this store:
    # the job's own, under a prefix of torch's.
    store = torch_store(PrefixStore("torch", w.job_store), w.loop)
    hook = sys.excepthook
    try:
        _td.init_process_group(
            BACKEND_NAME,
            store=store,
            rank=w.default_group.rank,
            world_size=w.default_group.size,
            timeout=datetime.timedelta(seconds=w.default_group.timeout),
            pg_options=LentJob(w),
        )
    finally:
        # torch's init prefixes uncaught tracebacks with "[rankN]:"; the sync face leaves output
        # alone (aiodist-run prefixes lines itself, and reads tracebacks in its summaries).
        sys.excepthook = hook
    pg = _td.distributed_c10d._get_default_group()
    _stores[id(pg)] = store
    return pg


def owns_default_group(pg: Any) -> bool:
    """True while ``pg`` (what ``initialise`` returned) is torch's default group."""
    return bool(_td.is_initialized()) and _td.distributed_c10d._get_default_group() is pg


def release(pg: Any) -> None:
    """Destroy torch's groups if ``pg`` is still torch's default group (else leave torch alone)."""
    try:
        if owns_default_group(pg):
            _td.destroy_process_group()
    finally:
        _stores.pop(id(pg), None)
