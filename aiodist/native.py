"""Which engine this process runs: the compiled parts where they were built, else Python.

The compiled parts (Cython, built by ``pip install`` where a C compiler is at hand: setup.py)
are twins of Python modules, with the same interface and the same answers; the Python ones stay
as the reference and the fallback. ``AIODIST_NATIVE`` chooses (``aiodist.settings.native_engine``):

* unset or ``auto``: the compiled parts that are built; a missing one is said once in the log
  (a warning: it runs, slower on small messages), and its Python twin runs;
* ``1``: the compiled parts must be there: a missing one raises, saying how to build it;
* ``0``: the Python engine, compiled parts or not.

The choice is made once per process, at the first use of a part, before any job's settings
exist (as pyzmq chooses its backend at import); ``Work``'s when ``aiodist.work`` loads
(``compiled_at_import``: every Work of a process is of one class), from the environment as it
is then, so a process that sets ``AIODIST_NATIVE`` must do so before it imports aiodist
(``aiodist.testing.spawn`` and the bench start their ranks with it set).
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

from aiodist import settings as _settings
from aiodist.errors import DistError

__all__ = ["READ_AT_IMPORT", "choice", "compiled", "compiled_at_import", "describe"]

log = logging.getLogger("aiodist")

#: The variables read as aiodist is imported (``compiled_at_import``): a process that sets them
#: must do so before.
READ_AT_IMPORT = ("AIODIST_NATIVE",)

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
    return _load(name, choice(), quiet=False)


def compiled_at_import(name: str) -> ModuleType | None:
    """``compiled(name)`` for a part chosen when its Python module loads (``aiodist.work``):
    ``AIODIST_NATIVE`` as it is now, without fixing the choice of the parts asked for later
    (a process may set the variable after importing aiodist, as ``aiodist.testing.spawn``
    does). Never raises nor warns: a bad or unmet ``AIODIST_NATIVE`` runs the Python twin here,
    and ``init_process_group`` raises it when the transport asks for its parts."""
    try:
        mode = _settings.native_engine()
    except DistError:
        mode = "off"
    return _load(name, "off" if mode == "off" else "auto", quiet=True)


def _load(name: str, mode: str, *, quiet: bool) -> ModuleType | None:
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
            if not quiet:
                log.warning(
                    "aiodist: %s is not built (%s): running its Python twin, slower on small "
                    "messages (reinstall aiodist where Cython and a C compiler are at hand; "
                    "AIODIST_NATIVE=0 chooses the Python engine without this warning)",
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
