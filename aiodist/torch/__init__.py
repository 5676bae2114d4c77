"""aiodist as a ``torch.distributed`` backend: ``import aiodist.torch``, then ``backend="aiodist"``.

Importing this package registers the backend name "aiodist" with torch for CPU tensors
(``"cpu:aiodist,cuda:nccl"`` puts CUDA tensors on NCCL); unchanged torch code then runs on
aiodist's runtime::

    import torch.distributed as dist
    import aiodist.torch  # noqa: F401

    dist.init_process_group("aiodist")  # or "cpu:aiodist,cuda:nccl"

The first group on "aiodist" builds a small C++ extension against the installed torch (once;
cached, see ``cache_dir``); ``build()`` does it ahead of time.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as _td

from aiodist.torch._backend import BACKEND_NAME as BACKEND_NAME
from aiodist.torch._backend import create_backend as _create_backend
from aiodist.torch._build import ExtensionBuildError as ExtensionBuildError
from aiodist.torch._build import cache_dir as cache_dir
from aiodist.torch._build import load_extension as _load_extension

__all__ = ["BACKEND_NAME", "ExtensionBuildError", "build", "cache_dir", "register", "resync"]


def register() -> None:
    """Register "aiodist" with ``torch.distributed`` (done on import; calling it again is harmless)."""
    if BACKEND_NAME.upper() in _td.Backend._plugins:
        return
    _td.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu"])


def build() -> Any:
    """Build (or load from the cache) the C++ extension now, instead of at the first group.

    Raises:
        ExtensionBuildError: no C++ compiler or ninja here, or the build failed.
    """
    return _load_extension()


def resync(group: Any = None, timeout: datetime.timedelta | float | None = None) -> Any:
    """Bring a torch process group on "aiodist" back in step after a failed collective.

    Every member calls it, after a timeout or a mismatch reported by a collective of the group
    (the next operations then say the group is out of step until it is resynced); see
    ``aiodist.resync`` for what it agrees on.

    Args:
        group: a torch ``ProcessGroup`` on "aiodist" (None: the default group).
        timeout: how long to wait for every member (``timedelta`` or seconds; default: the
            group's timeout).
    Returns:
        The ``ResyncReport`` (``next_op``, ``ranks_at``, ``completed``, ``disagreed``).
    Raises:
        ValueError: the group is not on "aiodist" in this process.
        DistTimeoutError: a member did not call resync in time.
        DistNetworkError: a member was lost or has left.
    """
    from aiodist.torch._backend import adapter_of

    pg = group if group is not None else _td.distributed_c10d._get_default_group()
    adapter = adapter_of(str(pg.group_name))
    if adapter is None:
        raise ValueError(
            f"resync: process group {pg.group_name!r} is not on the aiodist backend in this process"
        )
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    return adapter.resync(None if seconds is None else float(seconds))


register()
