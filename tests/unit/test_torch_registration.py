"""What ``import aiodist.torch`` tells torch: the devices "aiodist" is registered for, and the
frontend call torch gates on the name "gloo" (``monitored_barrier``) answered for "aiodist"."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as tdist  # noqa: E402
from torch.distributed import distributed_c10d as c10d  # noqa: E402

import aiodist.torch  # noqa: E402
from aiodist.torch._frontend import runs_cpu_on  # noqa: E402


def test_devices_follow_torchs_build() -> None:
    assert aiodist.torch.devices(cuda_built=True) == ["cpu", "cuda"]
    assert aiodist.torch.devices(cuda_built=False) == ["cpu"]
    expected = ["cpu", "cuda"] if torch.backends.cuda.is_built() else ["cpu"]
    assert aiodist.torch.devices() == expected


def test_registered_for_those_devices() -> None:
    assert "aiodist" in tdist.Backend.backend_list
    assert tdist.Backend.backend_capability["aiodist"] == aiodist.torch.devices()
    # init_process_group("aiodist") puts every registered device on aiodist (one backend object)
    config = c10d.BackendConfig(tdist.Backend("aiodist")).get_device_backend_map()
    assert config == dict.fromkeys(aiodist.torch.devices(), "aiodist")
    # a combined spec goes through torch's own parsing
    config = c10d.BackendConfig(tdist.Backend("cpu:aiodist,cuda:nccl")).get_device_backend_map()
    assert config == {"cpu": "aiodist", "cuda": "nccl"}
    aiodist.torch.register()  # again: harmless
    assert tdist.Backend.backend_list.count("aiodist") == 1


@pytest.mark.parametrize(
    ("spec", "on_aiodist"),
    [
        ("aiodist", True),
        ("AIODIST", True),
        ("gloo", False),
        ("cpu:aiodist,cuda:nccl", True),
        ("cuda:nccl, cpu:aiodist", True),
        ("cpu:gloo,cuda:aiodist", False),
        ("cuda:aiodist", False),
    ],
)
def test_which_groups_monitored_barrier_answers(spec: str, on_aiodist: bool) -> None:
    assert runs_cpu_on(spec, "aiodist") is on_aiodist


def test_monitored_barrier_is_answered_in_both_of_torchs_namespaces() -> None:
    wrapper = tdist.monitored_barrier
    assert c10d.monitored_barrier is wrapper
    original = wrapper.__aiodist_wraps__
    assert original.__module__ == "torch.distributed.distributed_c10d"
    assert wrapper.__doc__ == original.__doc__
    aiodist.torch.register()  # installing again does not wrap the wrapper
    assert tdist.monitored_barrier is wrapper
