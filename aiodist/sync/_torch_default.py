"""Whether the sync face's init also gives ``torch.distributed`` the same default group.

``AIODIST_TORCH_DEFAULT_GROUP`` decides, read at each init:

- ``auto`` (default): when the program has imported torch (a program of tensors has, before
  its init; one of numpy arrays does not pay for importing torch), and torch's own default
  group does not exist yet (a program that initialises torch.distributed itself keeps it);
- ``1``: always (torch must be importable, and torch's default group must not exist yet);
- ``0``: never (torch's helpers then see no default group: see docs/torch.md, "Drop-in for torch.distributed").

How it is done: ``aiodist.torch._default_group``.
"""

from __future__ import annotations

import sys
from typing import Any

from aiodist.errors import DistValueError
from aiodist.settings import Settings, torch_default_group

__all__ = ["MODE_VAR", "initialise_for_torch", "mode", "release_for_torch"]

MODE_VAR = "AIODIST_TORCH_DEFAULT_GROUP"

# torch's default group made by the last init (None: none), destroyed with the sync face's.
_torch_group: Any = None


def mode(given: str | None, settings: Settings) -> str:
    """``given`` (``init_process_group``'s ``torch_default_group``), else
    ``AIODIST_TORCH_DEFAULT_GROUP`` (``auto`` when unset).

    Raises:
        DistValueError: a value other than auto, 1 or 0.
    """
    if given is None:
        return torch_default_group(settings.torch_default_group, MODE_VAR)
    return torch_default_group(str(given), "torch_default_group")


def _wanted(how: str) -> bool:
    if how == "0" or (how == "auto" and "torch" not in sys.modules):
        return False
    try:
        import torch.distributed as td
    except ImportError as exc:
        raise DistValueError(f"{MODE_VAR}=1 needs torch, which cannot be imported here ({exc})") from exc
    if not td.is_available():
        if how == "1":
            raise DistValueError(f"{MODE_VAR}=1 needs torch built with distributed support")
        return False
    if td.is_initialized():
        if how == "1":
            raise DistValueError(
                f"{MODE_VAR}=1, and torch.distributed's default group exists already (this program "
                "initialised it): destroy it before aiodist.sync's init, or leave the variable unset"
            )
        return False  # the program's own: torch's helpers use it
    return True


def initialise_for_torch(how: str) -> None:
    """After the sync face's init: torch's default group on its job, if ``how`` asks for it.

    Raises:
        DistValueError: ``how`` is "1" and torch cannot have it (the message says why); or
            torch's init failed (the message says how to do without).
    """
    global _torch_group
    if not _wanted(how):
        return
    from aiodist.torch import _default_group

    try:
        _torch_group = _default_group.initialise()
    except Exception as exc:
        raise DistValueError(
            f"init_process_group: giving torch.distributed the same default group (for torch's helpers, "
            f"such as DistributedSampler) failed: {type(exc).__name__}: {exc}. Set {MODE_VAR}=0 to "
            "leave torch.distributed alone"
        ) from exc


def release_for_torch() -> None:
    """Destroy torch's default group of the last init, if torch still has it."""
    global _torch_group
    pg, _torch_group = _torch_group, None
    if pg is None:
        return
    from aiodist.torch import _default_group

    _default_group.release(pg)
