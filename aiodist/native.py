"""Which engine this process runs: the compiled parts where they were built, else Python.

The compiled parts (Cython, built by ``pip install`` where a C compiler is at hand: setup.py)
are twins of Python modules, with the same interface and the same answers; the Python ones stay
as the reference and the fallback. ``AIODIST_NATIVE`` chooses (``aiodist.settings.native_engine``):

* unset or ``auto``: the compiled parts that are built; a missing one is said once in the log
  (a warning: it runs, slower on small messages), and its Python twin runs;
* ``1``: the compiled parts must be there: a missing one raises, saying how to build it;
* ``0``: the Python engine, compiled parts or not.

The choice is made once per process, at the first use of a part, before any job's settings
exist (as pyzmq chooses its backend at import).
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

from aiodist import settings as _settings
from aiodist.errors import DistError

__all__ = ["choice", "compiled", "describe"]

log = logging.getLogger("aiodist")

_choice: str | None = None
_loaded: dict[str, ModuleType | None] = {}
_why: dict[str, str] = {}


def choice() -> str:
    """``AIODIST_NATIVE`` as read at the first use in this process: "auto", "on" or "off"."""
    global _choice
    if _choice is None:
        _choice = _settings.native_engine()
    return _choice


def compiled(name: str) -> ModuleType | None:
    """The compiled module ``name`` (``"aiodist.transport._shm_ring"``), or None where the Python
    twin runs (``AIODIST_NATIVE=0``, or it was not built and ``AIODIST_NATIVE`` is not 1).

    Raises:
        DistError: ``AIODIST_NATIVE=1`` and the module cannot be imported.
    """
    if name in _loaded:
        return _loaded[name]
    mode = choice()
    module: ModuleType | None = None
    if mode == "off":
        _why[name] = "AIODIST_NATIVE=0"
    else:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            if mode == "on":
                raise DistError(
                    f"AIODIST_NATIVE=1, but {name} cannot be imported ({exc}): it is built by "
                    "`pip install` where Cython and a C compiler are at hand (reinstall aiodist "
                    "with both), or unset AIODIST_NATIVE to run the Python engine"
                ) from exc
            _why[name] = f"not built ({exc})"
            log.warning(
                "aiodist: %s is not built (%s): running its Python twin, slower on small messages "
                "(reinstall aiodist where Cython and a C compiler are at hand; AIODIST_NATIVE=0 "
                "chooses the Python engine without this warning)",
                name,
                exc,
            )
    _loaded[name] = module
    return module


def describe() -> dict[str, str]:
    """For each part asked for so far: "compiled", or "python (why)"."""
    return {
        name: "compiled" if module is not None else f"python ({_why.get(name, '')})"
        for name, module in _loaded.items()
    }
