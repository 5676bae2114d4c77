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

from typing import Any

import torch.distributed as _td

from aiodist.torch._backend import BACKEND_NAME as BACKEND_NAME
from aiodist.torch._backend import create_backend as _create_backend
from aiodist.torch._build import ExtensionBuildError as ExtensionBuildError
from aiodist.torch._build import cache_dir as cache_dir
from aiodist.torch._build import load_extension as _load_extension

__all__ = ["BACKEND_NAME", "ExtensionBuildError", "build", "cache_dir", "register"]


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


register()
