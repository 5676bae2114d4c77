"""Device rules: which devices a backend on torch's engine runs, and one device per call.

A backend's binding applies them to each tensor the group's checks show it
(``aiodist.operations``).
"""

from __future__ import annotations

from aiodist.errors import DistValueError

__all__ = ["OneDevice", "check_device"]

#: The kind of device each backend on torch's engine runs, and what to do with a tensor elsewhere.
_ENGINE_DEVICES = {
    "nccl": ("cuda", "CUDA tensors only: move it to this rank's GPU (tensor.cuda()), or use backend 'tcp'"),
    "torch-gloo": (
        "cpu",
        "CPU tensors only: use backend 'nccl' for CUDA tensors, or 'tcp' (which stages them through host memory)",
    ),
}


def check_device(backend: str, arg: str, device_type: str, where: str) -> None:
    """Refuse a tensor on a device of type ``device_type`` (``where``: as the message names it)
    if the engine of ``backend`` ("nccl", "torch-gloo") does not run that kind of device.

    Raises:
        DistValueError: naming ``arg``, the device and what to use instead.
    """
    wanted, rule = _ENGINE_DEVICES[backend]
    if device_type != wanted:
        raise DistValueError(f"{arg} is on {where}, but backend {backend!r} runs {rule}")


class OneDevice:
    """All the tensors of one call are on one device: a binding keeps one per call and shows it
    each tensor's device (``check``) as the group's checks ask for the tensor."""

    __slots__ = ("first",)

    def __init__(self) -> None:
        self.first: tuple[str, str] | None = None

    def check(self, arg: str, device: str) -> None:
        """Raises DistValueError if ``arg``'s ``device`` is not the first tensor's."""
        if self.first is None:
            self.first = (arg, device)
        elif device != self.first[1]:
            raise DistValueError(
                f"the tensors of one call must be on one device: {self.first[0]} is on {self.first[1]} "
                f"but {arg} is on {device}"
            )
