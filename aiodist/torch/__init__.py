"""aiodist as a ``torch.distributed`` backend: ``import aiodist.torch``, then ``backend="aiodist"``.

Importing this package registers the backend name "aiodist" with torch for CPU tensors, and
for CUDA tensors where torch was built with CUDA (staged through pinned host memory;
``"cpu:aiodist,cuda:nccl"`` puts them on NCCL instead); unchanged torch code then runs on
aiodist's runtime::

    import torch.distributed as dist
    import aiodist.torch  # noqa: F401

    dist.init_process_group("aiodist")  # or "cpu:aiodist,cuda:nccl"

The first group on "aiodist" builds a small C++ extension against the installed torch (once;
cached, see ``cache_dir``), saying so on stderr; ``build()`` or ``python -m aiodist.torch
--build`` does it ahead of time.
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
from aiodist.torch._frontend import install as _install_frontend

__all__ = ["BACKEND_NAME", "ExtensionBuildError", "build", "cache_dir", "devices", "register", "resync"]


def devices(cuda_built: bool | None = None) -> list[str]:
    """The device types "aiodist" registers for: "cpu", and "cuda" where torch has CUDA.

    CUDA tensors on a group on "aiodist" travel through pinned host buffers (the staging path
    the other faces use); whether torch has CUDA is read from the build, which touches no
    device (``cuda_built`` overrides it).
    """
    import torch

    if cuda_built is None:
        cuda_built = bool(torch._C._has_cuda)  # what torch.backends.cuda.is_built() reads
    return ["cpu", "cuda"] if cuda_built else ["cpu"]


def register() -> None:
    """Register "aiodist" with ``torch.distributed`` (done on import; calling it again is harmless).

    Also answers ``torch.distributed.monitored_barrier`` for groups on "aiodist" (torch's
    frontend accepts gloo groups only; see ``aiodist.torch._frontend``).
    """
    _install_frontend(BACKEND_NAME)
    if BACKEND_NAME.upper() in _td.Backend._plugins:
        return
    _td.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=devices())


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
