"""Build (once) and load the C++ half of the backend: a ``c10d::Backend`` that forwards to aiodist.

The extension is compiled with ``torch.utils.cpp_extension.load`` against the installed torch,
the first time a process group on "aiodist" is created, into a cache directory keyed by the
torch version and the source's hash (``$AIODIST_CACHE_DIR``, else ``$XDG_CACHE_HOME/aiodist``,
else ``~/.cache/aiodist``). Later processes load the cached library in about a second.
Concurrent first builds (every rank of a job at once) wait for one another (torch's build lock).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

from aiodist.errors import DistError

__all__ = ["ExtensionBuildError", "build_seconds", "cache_dir", "load_extension"]

_SOURCE = Path(__file__).with_name("csrc") / "aiodist_backend.cpp"
_NAME = "aiodist_torch_backend"
_lock = threading.Lock()
_module: Any = None
_build_seconds: float | None = None


class ExtensionBuildError(DistError):
    """The C++ half of the torch backend could not be built (no compiler, no ninja, a build error)."""


def cache_dir() -> Path:
    """Where the built extension lives: one subdirectory per torch version and source hash."""
    import torch

    root = os.environ.get("AIODIST_CACHE_DIR")
    if root:
        base = Path(root)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = (Path(xdg) if xdg else Path.home() / ".cache") / "aiodist"
    digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]
    tag = f"torch-{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}-{digest}"
    return base / "torch-backend" / tag.replace("+", "_")


def _check_toolchain() -> None:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None and shutil.which("g++") is None:
        raise ExtensionBuildError(
            f"the 'aiodist' torch backend builds a small C++ extension on first use, and no C++ "
            f"compiler was found ({compiler!r} or 'g++' on PATH; set CXX to choose one). Install one "
            "(e.g. 'apt-get install g++'), or use aiodist without torch's backend registry: "
            "'import aiodist.sync as dist' runs torch.distributed code unchanged."
        )
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        raise ExtensionBuildError(
            "the 'aiodist' torch backend builds a small C++ extension on first use, which needs "
            "ninja ('pip install ninja' or 'apt-get install ninja-build')"
        )


def load_extension() -> Any:
    """The compiled extension module (building it first if the cache has none).

    Raises:
        ExtensionBuildError: no compiler or ninja, or the build failed (the compiler's output
            is in the message).
    """
    global _module, _build_seconds
    with _lock:
        if _module is not None:
            return _module
        t0 = time.perf_counter()
        where = cache_dir()
        built = where / f"{_NAME}.so"
        if built.is_file() and not (where / "lock").exists():  # "lock": a build is under way
            # Built before for this torch and this source: no compiler needed to load it.
            _module = _import_built(built)
            _build_seconds = time.perf_counter() - t0
            return _module
        _check_toolchain()
        from torch.utils import cpp_extension

        where.mkdir(parents=True, exist_ok=True)
        try:
            _module = cpp_extension.load(
                name=_NAME,
                sources=[str(_SOURCE)],
                build_directory=str(where),
                extra_cflags=["-O2"],
                verbose=False,
            )
        except Exception as exc:
            raise ExtensionBuildError(
                f"building the 'aiodist' torch backend extension in {where} failed: {exc}"
            ) from exc
        _build_seconds = time.perf_counter() - t0
        return _module


def _import_built(path: Path) -> Any:
    import torch.distributed  # noqa: F401  (the extension's base classes must be registered first)

    spec = importlib.util.spec_from_file_location(_NAME, path)
    if spec is None or spec.loader is None:
        raise ExtensionBuildError(f"cannot load the built extension {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_seconds() -> float | None:
    """How long this process's ``load_extension`` took (a build, or loading the cached library)."""
    return _build_seconds
