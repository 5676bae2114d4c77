"""The compiled parts of the engine, for their differential tests."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

import aiodist.native as native


def compiled_or_skip(module: str) -> ModuleType:
    """The compiled module ``module``. CI insists on it (``AIODIST_NATIVE=1``: its absence then
    fails the test); elsewhere its absence is a skip that names the cause, never a pass."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if native.choice() == "on":
            raise
        pytest.skip(f"{module} is not built here ({exc}): pip install with Cython and a C compiler")
