"""Data parallelism: ``DistributedDataParallel`` (torch modules), ``GradBucketer`` (numpy), bucketing.

``DistributedDataParallel``, ``GradBucket`` and ``aiodist.parallel.hooks`` need torch and load it
on first use; the rest works without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from aiodist.parallel.bucketing import (
    DEFAULT_FIRST_BUCKET_BYTES as DEFAULT_FIRST_BUCKET_BYTES,
)
from aiodist.parallel.bucketing import (
    TensorSpec as TensorSpec,
)
from aiodist.parallel.bucketing import (
    bucket_size_limits as bucket_size_limits,
)
from aiodist.parallel.bucketing import (
    compute_bucket_assignment_by_size as compute_bucket_assignment_by_size,
)
from aiodist.parallel.bucketing import (
    ddp_buckets as ddp_buckets,
)
from aiodist.parallel.bucketing import (
    reverse_order_buckets as reverse_order_buckets,
)
from aiodist.parallel.grad_bucketer import GradBucketer as GradBucketer

if TYPE_CHECKING:
    from aiodist.parallel import hooks as hooks
    from aiodist.parallel.distributed import DistributedDataParallel as DistributedDataParallel
    from aiodist.parallel.distributed import GradBucket as GradBucket

__all__ = [
    "DEFAULT_FIRST_BUCKET_BYTES",
    "DistributedDataParallel",
    "GradBucket",
    "GradBucketer",
    "TensorSpec",
    "bucket_size_limits",
    "compute_bucket_assignment_by_size",
    "ddp_buckets",
    "hooks",
    "reverse_order_buckets",
]

_LAZY = {
    "DistributedDataParallel": "aiodist.parallel.distributed",
    "GradBucket": "aiodist.parallel.distributed",
}


def __getattr__(name: str) -> Any:
    # torch is optional: import the torch-based parts on first use only.
    if name == "hooks":
        return importlib.import_module("aiodist.parallel.hooks")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'aiodist.parallel' has no attribute {name!r}")
