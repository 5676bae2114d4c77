"""torch's frontend calls that torch itself gates on the backend's name, answered for "aiodist".

``torch.distributed.monitored_barrier`` raises "monitored_barrier is only implemented for GLOO
backend" for any group whose backend is not named "gloo", before it reaches the group: the
check is in torch's Python frontend only. Below it, torch dispatches the group's
``monitored_barrier(timeout, wait_all_ranks)`` to the CPU backend's ``monitoredBarrier``, which
aiodist's backend implements (``Adapter.monitored_barrier``: rank 0 names the ranks that did
not arrive). So ``install()`` puts a wrapper in the place of torch's function (in
``torch.distributed`` and ``torch.distributed.distributed_c10d``) that sends groups whose CPU
tensors are on "aiodist" to the group's method and everything else to torch's function,
unchanged. Code that took torch's function by name before ``import aiodist.torch`` keeps
torch's function.
"""

from __future__ import annotations

import datetime
import functools
import warnings
from typing import Any

import torch.distributed as _td
from torch.distributed import distributed_c10d as _c10d

__all__ = ["install", "runs_cpu_on"]


def runs_cpu_on(spec: str, backend: str) -> bool:
    """True when the backend spec ``spec`` ("aiodist", "cpu:aiodist,cuda:nccl") puts CPU tensors on ``backend``."""
    spec = spec.strip().lower()
    if ":" not in spec:
        return spec == backend
    for pair in spec.split(","):
        device, _, name = pair.partition(":")
        if device.strip() == "cpu":
            return name.strip() == backend
    return False


def _monitored_barrier_for(original: Any, backend: str) -> Any:
    @functools.wraps(original)
    def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> Any:
        # Non-members (torch warns and returns) and groups on other backends: torch's own.
        if _c10d._rank_not_in_group(group) or not runs_cpu_on(str(_c10d.get_backend(group)), backend):
            return original(group, timeout, wait_all_ranks)
        pg: Any = _c10d._get_default_group() if group is None else group
        if timeout is None:  # the group's own timeout (torch's documented default)
            return pg.monitored_barrier(wait_all_ranks=wait_all_ranks)
        if isinstance(timeout, int | float):  # as torch: seconds, with its warning
            warnings.warn(
                "Please specify timeout arg as a timedelta. "
                f"Converting current value of {timeout} assuming it represents seconds",
                stacklevel=2,
            )
            timeout = datetime.timedelta(seconds=timeout)
        _c10d._check_valid_timeout(timeout)
        return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    monitored_barrier.__aiodist_wraps__ = original  # type: ignore[attr-defined]
    return monitored_barrier


def install(backend: str) -> None:
    """Answer ``torch.distributed.monitored_barrier`` for groups on ``backend`` (idempotent)."""
    current = _c10d.monitored_barrier
    if getattr(current, "__aiodist_wraps__", None) is not None:
        return
    wrapper = _monitored_barrier_for(current, backend)
    _c10d.monitored_barrier = wrapper
    if getattr(_td, "monitored_barrier", None) is current:
        _td.monitored_barrier = wrapper
