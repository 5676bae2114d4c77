"""Build (once) and load the C++ half of the backend: a ``c10d::Backend`` that forwards to aiodist.

The extension is compiled with ``torch.utils.cpp_extension.load`` against the installed torch,
the first time a process group on "aiodist" is created (or by ``python -m aiodist.torch
--build``), into a cache directory keyed by the torch version and the source's hash
(``$AIODIST_CACHE_DIR``, else ``$XDG_CACHE_HOME/aiodist``, else ``~/.cache/aiodist``). Later
processes load the cached library in about a second.

A compile takes 30 s to 2 minutes, so a process about to compile (or to wait for another that
compiles) says so on stderr, once. Every rank of a job may reach the first build at once: one
compiles, under an exclusive ``flock`` of the cache directory (the kernel releases it when its
holder dies, so a killed build never blocks later ones, as a leftover lock file would); the
others wait for the lock, then load what it built. The library is compiled in a ``build``
subdirectory and published by an atomic rename, so a library found in the cache is always
complete and loading it needs no lock.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import importlib.util
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aiodist.errors import DistError

__all__ = ["ExtensionBuildError", "build_seconds", "cache_dir", "load_extension"]

_SOURCE = Path(__file__).with_name("csrc") / "aiodist_backend.cpp"
_NAME = "aiodist_torch_backend"
_lock = threading.Lock()
#: How long, at exit, the completions still running may take (then they are left as they are).
_CLOSE_SECONDS = 5.0
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
        # Built before for this torch and this source (published whole): no compiler needed.
        _module = _import_built(built) if built.is_file() else _build(where, built)
        _build_seconds = time.perf_counter() - t0
        # The extension's thread runs the completions of work futures; at exit they end before
        # Python finalizes (letting go of a tensor later would abort the process: see the
        # Completer in the source). Bounded, for a completion that never ends.
        atexit.register(_module._close_completions, _CLOSE_SECONDS)
        return _module


def _build(where: Path, built: Path) -> Any:
    """Compile the extension into ``where`` (or wait for the process compiling it) and load it."""
    _check_toolchain()
    where.mkdir(parents=True, exist_ok=True)
    with _build_lock(where):
        if built.is_file():  # another process built it while this one waited
            return _import_built(built)
        _say(
            f"compiling the C++ extension of the torch backend 'aiodist' against torch "
            f"{_torch_version()}: once per torch version, typically 30 s to 2 minutes (into {where}; "
            "'python -m aiodist.torch --build' does this ahead of time)"
        )
        t0 = time.perf_counter()
        module = _compile(where / "build")
        tmp = where / f".{_NAME}.so.{os.getpid()}"
        shutil.copyfile(where / "build" / f"{_NAME}.so", tmp)
        os.replace(tmp, built)  # atomic: a reader finds the whole library or none
        _say(f"the torch backend's C++ extension is built ({time.perf_counter() - t0:.0f} s)")
        return module


@contextlib.contextmanager
def _build_lock(where: Path) -> Iterator[None]:
    """Hold the cache directory's build lock; say so first when another process holds it."""
    with open(where / "build.lock", "a+b") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(
                "waiting for another process to finish compiling the C++ extension of the torch "
                f"backend 'aiodist' (typically 30 s to 2 minutes; in {where})"
            )
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _compile(build_dir: Path) -> Any:
    """Run torch's compile in ``build_dir`` (the caller holds the build lock)."""
    from torch.utils import cpp_extension

    build_dir.mkdir(exist_ok=True)
    # torch's own lock file: one left there by a build that was killed would make torch wait
    # for it forever; under our lock nobody else is building, so any that exists is stale.
    with contextlib.suppress(FileNotFoundError):
        (build_dir / "lock").unlink()
    try:
        return cpp_extension.load(
            name=_NAME,
            sources=[str(_SOURCE)],
            build_directory=str(build_dir),
            extra_cflags=["-O2"],
            verbose=False,
        )
    except Exception as exc:
        raise ExtensionBuildError(
            f"building the 'aiodist' torch backend extension in {build_dir} failed: {exc}"
        ) from exc


def _say(text: str) -> None:
    """One line on stderr: a compile is long enough that silence reads as a hang."""
    print(f"aiodist: {text}", file=sys.stderr, flush=True)


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


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
