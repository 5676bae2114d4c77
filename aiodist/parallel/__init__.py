"""Data parallelism: DDP-style gradient bucketing (``DistributedDataParallel`` to come)."""

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

__all__ = [
    "DEFAULT_FIRST_BUCKET_BYTES",
    "TensorSpec",
    "bucket_size_limits",
    "compute_bucket_assignment_by_size",
    "ddp_buckets",
]
