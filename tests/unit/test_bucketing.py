"""Bucketing is checked against torch itself: its C++ assignment function and a real DDP Reducer."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aiodist.parallel as parallel
from aiodist.errors import DistTypeError, DistValueError
from aiodist.parallel import (
    DEFAULT_FIRST_BUCKET_BYTES,
    TensorSpec,
    bucket_size_limits,
    compute_bucket_assignment_by_size,
    ddp_buckets,
)

MIB = 1024 * 1024
NUMPY_DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "float64": np.float64,
    "int64": np.int64,
    "bfloat16": ml_dtypes.bfloat16,
}


def _random_case(rng: random.Random, dtypes: list[str], devices: list[str]) -> dict[str, Any]:
    """One random input: specs, limits, and sometimes sparse flags and tensor indices."""
    count = rng.randint(1, 40)
    # Skewed towards small tensors, with a tail up to ~3M elements and a few empty ones.
    specs = [
        (
            int(rng.random() ** 4 * 3_000_000) if rng.random() > 0.05 else 0,
            rng.choice(dtypes),
            rng.choice(devices),
        )
        for _ in range(count)
    ]
    limits = [
        int(rng.random() ** 3 * 40 * MIB) if rng.random() > 0.05 else 0 for _ in range(rng.randint(1, 3))
    ]
    sparse = [rng.random() < 0.2 for _ in range(count)] if rng.random() < 0.5 else None
    indices: list[int] | None = None
    if rng.random() < 0.5:
        indices = list(range(count))
        rng.shuffle(indices)
    elif rng.random() < 0.1:
        indices = []  # torch reads an empty list as "no indices"
    return {"specs": specs, "limits": limits, "sparse": sparse, "indices": indices}


def _torch_tensors(specs: list[tuple[int, str, str]]) -> list[Any]:
    torch = pytest.importorskip("torch")
    # Stride 0: the right numel and dtype without allocating gigabytes.
    return [
        torch.empty_strided((numel,), (0,), dtype=getattr(torch, dtype), device=device)
        for numel, dtype, device in specs
    ]


def _numpy_arrays(specs: list[tuple[int, str, str]]) -> list[np.ndarray[Any, Any]]:
    return [np.broadcast_to(np.empty(1, NUMPY_DTYPES[dtype]), (numel,)) for numel, dtype, _ in specs]


def _tensor_specs(specs: list[tuple[int, str, str]]) -> list[TensorSpec]:
    return [
        TensorSpec(numel * np.dtype(NUMPY_DTYPES[dtype]).itemsize, dtype, device)
        for numel, dtype, device in specs
    ]


def _torch_reference(case: dict[str, Any]) -> tuple[list[list[int]], list[int]]:
    torch = pytest.importorskip("torch")
    buckets, limits = torch.distributed._compute_bucket_assignment_by_size(
        _torch_tensors(case["specs"]), case["limits"], case["sparse"] or [], case["indices"] or []
    )
    return [list(bucket) for bucket in buckets], list(limits)


def _ours(tensors: list[Any], case: dict[str, Any]) -> tuple[list[list[int]], list[int]]:
    return compute_bucket_assignment_by_size(tensors, case["limits"], case["sparse"], case["indices"])


def test_random_inputs_match_torch_for_tensors_arrays_and_specs() -> None:
    pytest.importorskip("torch")
    rng = random.Random(20240611)
    for _ in range(300):
        case = _random_case(rng, ["float32", "float16", "float64", "int64"], ["cpu"])
        expected = _torch_reference(case)
        assert _ours(_torch_tensors(case["specs"]), case) == expected, case
        assert _ours(_numpy_arrays(case["specs"]), case) == expected, case
        assert _ours(_tensor_specs(case["specs"]), case) == expected, case


def test_unsorted_bucket_order_follows_torch_hash_map() -> None:
    # With tensor_indices torch leaves the open buckets in its std::unordered_map's order. Up to 30
    # distinct (dtype, device) keys make that map grow twice (13 -> 29 -> 59 hash buckets).
    pytest.importorskip("torch")
    dtypes = ["uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"]
    dtypes += ["complex64", "complex128", "bool", "bfloat16", "uint16", "uint32", "uint64"]
    keys = [(dtype, device) for dtype in dtypes for device in ["cpu", "meta"]]
    rng = random.Random(7)
    for trial in range(100):
        chosen = rng.sample(keys, len(keys) if trial % 4 == 0 else rng.randint(1, len(keys)))
        chosen += [rng.choice(chosen) for _ in range(rng.randint(0, 10))]
        rng.shuffle(chosen)
        specs = [(rng.randint(0, 1000), dtype, device) for dtype, device in chosen]
        indices = list(range(len(specs)))
        rng.shuffle(indices)
        case = {"specs": specs, "limits": [rng.choice([1 << 60, 2000])], "sparse": None, "indices": indices}
        tensors = _torch_tensors(specs)
        expected = _torch_reference(case)
        assert _ours(tensors, case) == expected, case
        assert _ours([TensorSpec(int(t.nbytes), t.dtype, t.device) for t in tensors], case) == expected, case


def test_bucket_size_limits_match_torch_ddp_config() -> None:
    assert DEFAULT_FIRST_BUCKET_BYTES == 1024 * 1024
    assert bucket_size_limits(25) == [MIB, 25 * MIB]
    assert bucket_size_limits(2.5, 1000) == [1000, int(2.5 * MIB)]
    # torch drops the first cap when it would not be the smaller one.
    assert bucket_size_limits(1) == [MIB]
    assert bucket_size_limits(0.5) == [MIB // 2]
    with pytest.raises(DistValueError):
        bucket_size_limits(-1)


def test_ddp_buckets_shapes() -> None:
    # 6 parameters of 400 KiB: forward order fills [0, 1, 2] up to 1 MiB, then the rest.
    params = [TensorSpec(400 * 1024, "float32") for _ in range(6)]
    assert ddp_buckets(params, 25) == ([[3, 4, 5], [0, 1, 2]], [25 * MIB, MIB])
    ready = list(range(6))[::-1]
    assert ddp_buckets(params, 25, grad_ready_order=ready) == ([[5, 4, 3], [2, 1, 0]], [MIB, 25 * MIB])
    with pytest.raises(DistValueError):
        ddp_buckets(params, 25, grad_ready_order=[0, 1, 2])


def test_misuse_is_reported() -> None:
    spec = TensorSpec(4, "float32")
    with pytest.raises(DistValueError):
        compute_bucket_assignment_by_size([], [10])
    with pytest.raises(DistValueError):
        compute_bucket_assignment_by_size([spec], [])
    with pytest.raises(DistValueError):
        compute_bucket_assignment_by_size([spec], [-1])
    with pytest.raises(DistValueError):
        compute_bucket_assignment_by_size([spec, spec], [10], [True])
    with pytest.raises(DistValueError):
        compute_bucket_assignment_by_size([spec, spec], [10], None, [0])
    with pytest.raises(DistValueError):
        compute_bucket_assignment_by_size([spec], [10], [False], [3])
    with pytest.raises(DistValueError):
        compute_bucket_assignment_by_size([TensorSpec(-1, "float32")], [10])
    with pytest.raises(DistTypeError):
        compute_bucket_assignment_by_size([[1.0, 2.0]], [10])
    with pytest.raises(DistTypeError):
        compute_bucket_assignment_by_size([TensorSpec(4, "float128")], [10])
    with pytest.raises(DistTypeError):
        compute_bucket_assignment_by_size([TensorSpec(4, "float32", "tpu:0")], [10])
    with pytest.raises(DistTypeError):
        compute_bucket_assignment_by_size([np.empty(2, dtype=object)], [10])


def test_sparse_torch_tensor_is_rejected() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(DistValueError):
        compute_bucket_assignment_by_size([torch.zeros(3, 3).to_sparse()], [10])


def test_dtype_spellings_agree() -> None:
    torch = pytest.importorskip("torch")
    spellings = ["float32", "torch.float32", "f4", np.float32, np.dtype("float32"), torch.float32]
    specs = [TensorSpec(8, dtype) for dtype in spellings]
    # All one key, so all one bucket.
    assert compute_bucket_assignment_by_size(specs, [1 << 20]) == ([list(range(6))], [1 << 20])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 5000), st.sampled_from(["float32", "float16", "int64"])),
        min_size=1,
        max_size=30,
    ),
    st.lists(st.integers(0, 20000), min_size=1, max_size=3),
)
def test_buckets_partition_the_tensors(specs: list[tuple[int, str]], limits: list[int]) -> None:
    tensors = [TensorSpec(nbytes, dtype) for nbytes, dtype in specs]
    buckets, bucket_limits = compute_bucket_assignment_by_size(tensors, limits)
    assert sorted(i for bucket in buckets for i in bucket) == list(range(len(specs)))
    assert len(bucket_limits) == len(buckets)
    assert [min(bucket) for bucket in buckets] == sorted(min(bucket) for bucket in buckets)
    for bucket in buckets:
        assert len({specs[i][1] for i in bucket}) == 1
    for bucket, limit in zip(buckets, bucket_limits, strict=True):
        # Every tensor but the last went in while the bucket was under its limit.
        assert len(bucket) == 1 or sum(specs[i][0] for i in bucket[:-1]) < limit


def test_package_exports_and_no_torch_import() -> None:
    assert {"DEFAULT_FIRST_BUCKET_BYTES", "TensorSpec", "bucket_size_limits"} <= set(parallel.__all__)
    assert {"compute_bucket_assignment_by_size", "ddp_buckets"} <= set(parallel.__all__)
    code = (
        "import sys, numpy as np\n"
        "from aiodist.parallel.bucketing import compute_bucket_assignment_by_size as f\n"
        "assert f([np.zeros(3), np.zeros(2, np.float32)], [8]) == ([[0], [1]], [8, 8])\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# Runs torch DDP on a one-rank gloo group (in-memory HashStore, no ports) in a child process, so
# that torch's default process group never leaks into other tests. For every model it reports the
# parameter specs, the order in which their gradients became ready, and torch's buckets.
_DDP_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)  # tiny models; threads would only contend with other test processes
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    class Mixed(torch.nn.Module):
        # Parameters of several dtypes, used in a shuffled order so gradients come back shuffled.
        def __init__(self):
            super().__init__()
            dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
            self.ps = torch.nn.ParameterList(
                torch.nn.Parameter(torch.zeros(1000 + 7919 * i % 60000, dtype=dtypes[i * 5 % 4]))
                for i in range(24)
            )
            self.use = [(i * 7) % 24 for i in range(24)]

        def forward(self, x):
            for i in self.use:
                x = x * 1.0001 + self.ps[i].double().sum()
            return x

    def mlp(width, depth):
        layers = [torch.nn.Linear(width, width) for _ in range(depth)]
        return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))

    def sparse_model():
        return torch.nn.Sequential(
            torch.nn.EmbeddingBag(5000, 64, mode="sum", sparse=True), torch.nn.Linear(64, 300), torch.nn.Linear(300, 2)
        )

    def inputs(name):
        if name.startswith("mixed"):
            return (torch.ones((), dtype=torch.float64),)
        if name.startswith("sparse"):
            return (torch.randint(0, 5000, (4, 3)),)
        return (torch.randn(2, 512 if name.startswith("big") else 256),)

    def noop_hook(state, bucket):
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    cases = {
        "big_init": (lambda: mlp(512, 3), dict(find_unused_parameters=True)),
        "big_rebuild": (lambda: mlp(512, 3), dict()),
        "small_init_cap": (lambda: mlp(256, 6), dict(find_unused_parameters=True, bucket_cap_mb=0.5)),
        "small_rebuild_cap": (lambda: mlp(256, 6), dict(bucket_cap_mb=0.3)),
        "mixed_init": (Mixed, dict(find_unused_parameters=True)),
        "mixed_init_cap": (Mixed, dict(find_unused_parameters=True, bucket_cap_mb=0.2)),
        "mixed_rebuild_cap": (Mixed, dict(bucket_cap_mb=0.2)),
        "sparse_init": (sparse_model, dict(find_unused_parameters=True, bucket_cap_mb=0.1)),
    }
    report = {}
    for name, (make, kwargs) in cases.items():
        torch.manual_seed(0)
        model = make()
        params = list(model.parameters())
        position = {id(p): i for i, p in enumerate(params)}
        ready = []
        for p in params:
            p.register_post_accumulate_grad_hook(lambda p: ready.append(position[id(p)]))
        ddp = DDP(model, **kwargs)
        entry = {
            "specs": [[p.numel() * p.element_size(), str(p.dtype)] for p in params],
            "sparse": [isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse
                       for m in model.modules() for _ in m.parameters(recurse=False)],
        }
        if name.startswith("sparse"):
            entry["bucket_sizes"] = ddp._get_ddp_logging_data()["bucket_sizes"]
        else:
            ddp.register_comm_hook(None, noop_hook)
            # The Reducer's current buckets, bucket 0 first.
            entry["init"] = [[position[id(p)] for p in b.parameters()]
                             for b in ddp.reducer._get_zeros_like_grad_buckets()]
            # torch rebuilds at the second forward and logs it from the third on.
            for _ in range(3):
                ready.clear()
                ddp(*inputs(name)).sum().backward()
                if "ready" not in entry:
                    entry["ready"] = list(ready)
            data = ddp._get_ddp_logging_data()
            entry["rebuilt"] = data.get("rebuilt_per_bucket_param_indices")
        report[name] = entry
    json.dump(report, sys.stdout)
    """
)


# The comparisons with a real Reducer run torch's DDP on a gloo group in a child process (2-3 s
# of the in-memory tiers' time): they belong to the integration tier (``make test`` runs them).
torch_ddp = pytest.mark.integration


@pytest.fixture(scope="module")
def ddp_report() -> dict[str, Any]:
    pytest.importorskip("torch")
    done = subprocess.run(
        [sys.executable, "-c", _DDP_SCRIPT], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def _specs(entry: dict[str, Any]) -> list[TensorSpec]:
    return [TensorSpec(nbytes, dtype) for nbytes, dtype in entry["specs"]]


def _parse_rebuilt(text: str) -> list[list[int]]:
    return [[int(i) for i in bucket.split()] for bucket in text.split(",")]


# bucket_cap_mb=None in torch means 25 MiB with a 1 MiB first bucket; an explicit cap X makes
# torch's first bucket X as well.
_DDP_CAPS = {
    "big_init": (25, MIB),
    "big_rebuild": (25, MIB),
    "small_init_cap": (0.5, MIB // 2),
    "small_rebuild_cap": (0.3, int(0.3 * MIB)),
    "mixed_init": (25, MIB),
    "mixed_init_cap": (0.2, int(0.2 * MIB)),
    "mixed_rebuild_cap": (0.2, int(0.2 * MIB)),
    "sparse_init": (0.1, int(0.1 * MIB)),
}


@torch_ddp
@pytest.mark.parametrize("name", [name for name in _DDP_CAPS if "_init" in name and "sparse" not in name])
def test_ddp_buckets_match_torch_reducer_at_construction(ddp_report: dict[str, Any], name: str) -> None:
    entry = ddp_report[name]
    cap_mb, first = _DDP_CAPS[name]
    buckets, _ = ddp_buckets(_specs(entry), cap_mb, first)
    assert len(buckets) > 1
    assert buckets == entry["init"]
    # find_unused_parameters=True never rebuilds.
    assert entry["rebuilt"] is None


@torch_ddp
@pytest.mark.parametrize("name", [name for name in _DDP_CAPS if "_rebuild" in name])
def test_ddp_buckets_match_torch_reducer_after_rebuild(ddp_report: dict[str, Any], name: str) -> None:
    entry = ddp_report[name]
    cap_mb, first = _DDP_CAPS[name]
    specs = _specs(entry)
    # Before the first backward torch uses one bucket per dtype (limit sys.maxsize).
    unbucketed, _ = compute_bucket_assignment_by_size(specs, [sys.maxsize])
    assert entry["init"] == unbucketed[::-1]
    buckets, _ = ddp_buckets(specs, cap_mb, first, grad_ready_order=entry["ready"])
    assert len(buckets) > 1
    assert buckets == _parse_rebuilt(entry["rebuilt"])


@torch_ddp
def test_ddp_buckets_match_torch_reducer_with_sparse_gradients(ddp_report: dict[str, Any]) -> None:
    entry = ddp_report["sparse_init"]
    cap_mb, first = _DDP_CAPS["sparse_init"]
    assert entry["sparse"][0] is True
    buckets, limits = ddp_buckets(_specs(entry), cap_mb, first, expect_sparse_gradient=entry["sparse"])
    sizes = [sum(entry["specs"][i][0] for i in bucket) for bucket in buckets]
    assert ", ".join(map(str, sizes)) == entry["bucket_sizes"]
    assert buckets[-1] == [0] and limits[-1] == 0
