"""DistributedDataParallel and GradBucketer: semantics, hooks, and errors.

Most tests run every rank in one process: the ranks' groups share an in-memory transport on
the test's event loop, and each rank's DDP runs in its own thread, as it would next to the
sync face's loop thread. FAULTS #26 (an extra parameter, an unused parameter, a late rank)
runs in real processes over loopback TCP.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import pytest

import aiodist
from aiodist.errors import DistError, DistTimeoutError, DistTypeError, DistValueError
from aiodist.group import ProcessGroup
from aiodist.parallel import GradBucketer, TensorSpec, reverse_order_buckets
from aiodist.testing import run_memory_world, spawn
from aiodist.testing.memory import memory_world

torch = pytest.importorskip("torch")

from aiodist.parallel import DistributedDataParallel as DDP  # noqa: E402
from aiodist.parallel import hooks  # noqa: E402

T = TypeVar("T")


async def _ranks_in_threads(size: int, fn: Callable[[ProcessGroup], T], timeout: float = 30.0) -> list[T]:
    """Run ``fn(group)`` for every rank of an in-memory world, each in its own thread."""
    fabric, groups = memory_world(size, timeout=timeout)
    try:
        return list(
            await asyncio.wait_for(asyncio.gather(*(asyncio.to_thread(fn, g) for g in groups)), timeout)
        )
    finally:
        for t in fabric.transports:
            t.abort()


def _mlp(seed: int, width: int = 24) -> Any:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, width),
        torch.nn.Tanh(),
        torch.nn.Linear(width, width),
        torch.nn.Tanh(),
        torch.nn.Linear(width, 2),
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _data(rank: int, step: int = 0) -> Any:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(5, 6, generator=g)


def _local_grads(model: Any, x: Any) -> list[Any]:
    model.zero_grad()
    model(x).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("as_view", [False, True])
async def test_gradients_are_averaged_in_several_buckets(size: int, as_view: bool) -> None:
    reference = _mlp(0)
    expected = [torch.zeros_like(p) for p in reference.parameters()]
    for r in range(size):
        for e, g in zip(expected, _local_grads(copy.deepcopy(reference), _data(r)), strict=True):
            e += g / size
    models = [_mlp(r) for r in range(size)]  # different initial weights: rank 0's must win

    def rank_fn(group: ProcessGroup) -> Any:
        model = models[group.rank]
        ddp = DDP(model, group, bucket_cap_mb=0.001, gradient_as_bucket_view=as_view)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(p, q)
        ddp(_data(group.rank)).pow(2).sum().backward()
        if as_view:
            flats = [b.flat for b in ddp.reducer._buckets]
            for p in model.parameters():
                assert any(f.data_ptr() <= p.grad.data_ptr() < f.data_ptr() + f.numel() * 4 for f in flats)
        return ddp.bucket_indices, [p.grad.clone() for p in model.parameters()]

    results = await _ranks_in_threads(size, rank_fn)
    buckets = results[0][0]
    assert len(buckets) > 1 and sorted(i for b in buckets for i in b) == list(range(6))
    assert [i for b in buckets for i in b] == list(range(5, -1, -1))  # reverse parameter order
    for _, grads in results:
        for g, e in zip(grads, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_first_bucket_is_one_mib_then_cap() -> None:
    # SPEC §8: reverse parameter order, a 1 MiB first bucket, then bucket_cap_mb.
    specs = [TensorSpec(4 * n, "float32") for n in (300_000, 200_000, 200_000, 100_000, 100_000)]
    # reverse: 0.4 + 0.4 + 0.8 MB = 1.6 MB >= 1 MiB closes bucket 0; then 2 MiB buckets.
    assert reverse_order_buckets(specs, 2.0) == [[4, 3, 2], [1, 0]]
    # A cap below 1 MiB is the cap of every bucket; dtypes never share a bucket.
    assert reverse_order_buckets(specs, 0.5) == [[4, 3], [2], [1], [0]]
    mixed = [TensorSpec(8, "float32"), TensorSpec(8, "float64"), TensorSpec(8, "float32")]
    assert sorted(map(sorted, reverse_order_buckets(mixed))) == [[0, 2], [1]]


async def test_no_sync_accumulates_then_averages_the_sum() -> None:
    size = 2
    reference = _mlp(0)
    expected = [torch.zeros_like(p) for p in reference.parameters()]
    for r in range(size):
        m = copy.deepcopy(reference)
        m.zero_grad()
        m(_data(r, 0)).pow(2).sum().backward()
        m(_data(r, 1)).pow(2).sum().backward()
        for e, p in zip(expected, m.parameters(), strict=True):
            e += p.grad / size
    models = [_mlp(r) for r in range(size)]

    def rank_fn(group: ProcessGroup) -> Any:
        model = models[group.rank]
        ddp = DDP(model, group, bucket_cap_mb=0.001)
        with ddp.no_sync():
            ddp(_data(group.rank, 0)).pow(2).sum().backward()
        local = [p.grad.clone() for p in model.parameters()]
        ddp(_data(group.rank, 1)).pow(2).sum().backward()
        return local, [p.grad.clone() for p in model.parameters()]

    (local0, g0), (local1, g1) = await _ranks_in_threads(size, rank_fn)
    assert not all(torch.equal(a, b) for a, b in zip(local0, local1, strict=True))  # not synced
    for a, b, e in zip(g0, g1, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
        assert torch.equal(a, b)


def _custom_hook(state: ProcessGroup, bucket: Any) -> Any:
    """A hook in torch's style that reduces through the async face's Work (sum, then halves)."""
    tensor = bucket.buffer()
    done = torch.futures.Future()

    def start() -> None:
        work = aiodist.all_reduce(tensor, group=state)
        hooks.work_future(work, tensor).then(lambda f: done.set_result(f.value().div_(state.size)))

    state.loop.call_soon_threadsafe(start)
    return done


@pytest.mark.parametrize(
    ("hook", "tol"),
    [
        (hooks.allreduce_hook, 1e-6),
        (hooks.fp16_compress_hook, 2e-3),
        (hooks.bf16_compress_hook, 2e-2),
        (_custom_hook, 1e-6),
    ],
)
async def test_comm_hooks(hook: Any, tol: float) -> None:
    size = 3
    reference = _mlp(0)
    expected = [torch.zeros_like(p) for p in reference.parameters()]
    for r in range(size):
        for e, g in zip(expected, _local_grads(copy.deepcopy(reference), _data(r)), strict=True):
            e += g / size
    models = [_mlp(r) for r in range(size)]
    seen: list[tuple[int, bool, int]] = []

    def rank_fn(group: ProcessGroup) -> Any:
        ddp = DDP(models[group.rank], group, bucket_cap_mb=0.001)

        def spy(state: Any, bucket: Any) -> Any:
            if group.rank == 0:
                seen.append((bucket.index(), bucket.is_last(), len(bucket.parameters())))
                assert bucket.buffer().numel() == sum(g.numel() for g in bucket.gradients())
            return hook(state, bucket)

        ddp.register_comm_hook(group, spy)
        with pytest.raises(DistValueError):
            ddp.register_comm_hook(group, spy)
        ddp(_data(group.rank)).pow(2).sum().backward()
        return [p.grad.clone() for p in models[group.rank].parameters()]

    for grads in await _ranks_in_threads(size, rank_fn):
        for g, e in zip(grads, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=tol, atol=tol)
    assert [s[0] for s in seen] == list(range(len(seen))) and seen[-1][1] and not seen[0][1]


class _TwoHeads(torch.nn.Module):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 1)
        self.spare = torch.nn.Linear(4, 1)  # never used in forward

    def forward(self, x: Any) -> Any:
        return self.head(torch.relu(self.body(x)))


async def test_unused_parameter_names_it_and_find_unused_tolerates_it() -> None:
    def rank_fn(group: ProcessGroup) -> Any:
        torch.manual_seed(0)
        strict = DDP(_TwoHeads(), group)
        with pytest.raises(DistError) as err:
            strict(torch.ones(2, 4)).sum().backward()
        lenient_model = _TwoHeads()
        lenient = DDP(lenient_model, group, find_unused_parameters=True)
        for _ in range(2):
            lenient(torch.ones(2, 4) * (group.rank + 1)).sum().backward()
        return str(err.value), lenient_model.spare.weight.grad, lenient_model.body.weight.grad

    for message, spare_grad, body_grad in await _ranks_in_threads(2, rank_fn):
        assert "'spare.weight'" in message and "'spare.bias'" in message
        assert "find_unused_parameters=True" in message
        assert spare_grad is None and body_grad is not None


async def test_shared_and_frozen_parameters() -> None:
    class Tied(torch.nn.Module):  # type: ignore[misc]
        def __init__(self, seed: int) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.a = torch.nn.Linear(3, 3)
            self.b = self.a  # shared: one parameter pair
            self.frozen = torch.nn.Linear(3, 3)
            self.frozen.requires_grad_(False)

        def forward(self, x: Any) -> Any:
            return self.b(self.a(x)) + self.frozen(x)

    models = [Tied(r) for r in range(2)]

    def rank_fn(group: ProcessGroup) -> Any:
        ddp = DDP(models[group.rank], group)
        ddp(torch.ones(1, 3)).sum().backward()
        return ddp.bucket_indices, [p.detach().clone() for p in models[group.rank].parameters()]

    (b0, p0), (_, p1) = await _ranks_in_threads(2, rank_fn)
    assert sorted(i for b in b0 for i in b) == [0, 1]  # a.weight, a.bias only
    for x, y in zip(p0, p1, strict=True):  # frozen ones were broadcast too
        assert torch.equal(x, y)


async def test_buffers_follow_rank_0_before_each_synced_forward() -> None:
    models = [torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)) for _ in range(2)]

    def rank_fn(group: ProcessGroup) -> Any:
        model = models[group.rank]
        ddp = DDP(model, group)
        bn = model[1]
        ddp(torch.randn(6, 3) + 3 * group.rank).sum().backward()  # local statistics diverge
        after_first = bn.running_mean.clone()
        ddp(torch.zeros(6, 3)).sum().backward()  # synced to rank 0's first, then updated alike
        return after_first, bn.running_mean.clone()

    (first0, second0), (first1, second1) = await _ranks_in_threads(2, rank_fn)
    assert not torch.equal(first0, first1)
    torch.testing.assert_close(second0, second1)


async def test_construction_on_the_loop_thread_is_refused() -> None:
    _, groups = memory_world(1)
    with pytest.raises(DistError, match="event-loop thread"):
        DDP(torch.nn.Linear(2, 2), groups[0])


async def test_sparse_and_paramless_modules_are_refused() -> None:
    _, groups = memory_world(1)
    with pytest.raises(DistValueError, match="sparse"):
        DDP(torch.nn.Embedding(4, 2, sparse=True), groups[0])
    with pytest.raises(DistValueError, match="no parameter"):
        DDP(torch.nn.ReLU(), groups[0])
    with pytest.raises(DistTypeError):
        DDP(object(), groups[0])


# -- GradBucketer ------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3])
async def test_grad_bucketer_averages_in_any_marking_order(size: int) -> None:
    shapes = [(300,), (20, 20), (7,), (1000,), (3, 5), (50,)]
    dtypes = [np.float32, np.float32, np.float64, np.float32, np.float64, np.float16]

    async def rank_fn(group: ProcessGroup) -> Any:
        rng = np.random.default_rng(group.rank)
        grads = [np.empty(s, dtype=d) for s, d in zip(shapes, dtypes, strict=True)]
        bucketer = GradBucketer(grads, group, bucket_cap_mb=0.002, first_bucket_bytes=1024)
        for round_ in range(2):  # the bucketer serves round after round
            for g in grads:
                g[...] = (group.rank + 1) * (round_ + 1)
            for i in rng.permutation(len(grads)):  # each rank marks in its own order
                bucketer.mark_ready(int(i))
            grads[0][...] = -99  # changing an array after marking it does not change what is sent
            await bucketer.wait()
            for g in grads:
                np.testing.assert_allclose(g, (size + 1) / 2 * (round_ + 1))
        return bucketer.buckets

    for buckets in await run_memory_world(size, rank_fn):
        assert len(buckets) > 1 and sorted(i for b in buckets for i in b) == list(range(6))


async def test_grad_bucketer_results_and_early_start() -> None:
    async def rank_fn(group: ProcessGroup) -> Any:
        grads = [np.full(100, float(group.rank + 1), np.float32) for _ in range(4)]
        bucketer = GradBucketer(grads, group, bucket_cap_mb=0.0007, first_bucket_bytes=400)
        assert bucketer.buckets == [[3], [2, 1], [0]]
        bucketer.mark_ready(3)
        assert len(bucketer._works) == 1  # bucket 0 is in flight before the others are ready
        bucketer.mark_ready(1)
        bucketer.mark_ready(0)  # bucket 2 is full but waits for bucket 1 (same order on all ranks)
        assert len(bucketer._works) == 1
        bucketer.mark_ready(2)
        assert len(bucketer._works) == 3
        await bucketer.wait()
        return grads

    for grads in await run_memory_world(3, rank_fn):
        for g in grads:
            np.testing.assert_allclose(g, 2.0)


async def test_grad_bucketer_sum_and_errors() -> None:
    async def rank_fn(group: ProcessGroup) -> Any:
        ints = [np.full(4, group.rank, np.int64)]
        with pytest.raises(DistTypeError, match="average=False"):
            GradBucketer(ints, group)
        bucketer = GradBucketer(ints, group, average=False)
        bucketer.mark_ready(0)
        with pytest.raises(DistValueError, match="already marked"):
            bucketer.mark_ready(0)
        with pytest.raises(DistValueError, match="out of range"):
            bucketer.mark_ready(1)
        await bucketer.wait()
        pair = GradBucketer([np.ones(2, np.float32), np.ones(2, np.float32)], group)
        pair.mark_ready(0)
        with pytest.raises(DistValueError, match="gradients 1 were never marked ready"):
            await pair.wait()
        with pytest.raises(DistTypeError):
            GradBucketer([np.ones((4, 4), np.float32)[:, 1]], group)
        with pytest.raises(DistValueError):
            GradBucketer([], group)
        return ints[0]

    for total in await run_memory_world(3, rank_fn):
        np.testing.assert_array_equal(total, 3)


async def test_grad_bucketer_reports_the_first_failure_and_drops_the_rest_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A round whose buckets fail (rank 1 never reduces: each bucket times out) raises the first
    failure from wait(); the other buckets' failures follow from it and are not reported as
    errors nobody retrieved."""

    fabric, (group, _idle) = memory_world(2, timeout=0.1)
    grads = [np.ones(100, np.float32) for _ in range(4)]
    bucketer = GradBucketer(grads, group, bucket_cap_mb=0.0004, first_bucket_bytes=400)
    assert len(bucketer.buckets) == 3
    with caplog.at_level(logging.ERROR, logger="aiodist"):
        try:
            for i in range(4):
                bucketer.mark_ready(i)
            with pytest.raises(DistTimeoutError):
                await bucketer.wait()
            await asyncio.sleep(0.3)  # (the buckets still running end by their timeouts)
        finally:
            for t in fabric.transports:
                t.abort()
        gc.collect()
    assert [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()] == []


async def test_grad_bucketer_mark_ready_off_loop_is_refused() -> None:
    _, groups = memory_world(1)
    bucketer = GradBucketer([np.ones(3, np.float32)], groups[0])
    with pytest.raises(DistError, match="event loop"):
        await asyncio.to_thread(bucketer.mark_ready, 0)


# -- FAULTS #26 in real processes -----------------------------------------------------------


class _Model(torch.nn.Module):  # type: ignore[misc]
    def __init__(self, extra: bool = False, wide: bool = False) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 5 if wide else 4)
        self.out = torch.nn.Linear(5 if wide else 4, 1)
        if extra:
            self.extra = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x: Any) -> Any:
        return self.out(torch.relu(self.fc(x)))


def _faults_job(rank: int, world_size: int, late: float) -> dict[str, str]:
    import aiodist.sync as dist

    torch.set_num_threads(1)
    dist.init_process_group("tcp", timeout=2.0)
    seen: dict[str, str] = {}
    try:
        DDP(_Model(extra=rank == 1))
    except DistValueError as exc:
        seen["extra"] = str(exc)
    try:
        DDP(_Model(wide=rank == 1))
    except DistValueError as exc:
        seen["shape"] = str(exc)
    ddp = DDP(_Model())
    try:
        ddp(torch.ones(3, 4)).sum().backward()
    except DistError as exc:
        seen["unused"] = str(exc)
    if rank == 1:
        time.sleep(late)
    start = time.monotonic()
    try:
        DDP(_Model())
    except DistError as exc:
        seen["late"] = f"{type(exc).__name__}: {exc}"
    seen["late_after"] = f"{time.monotonic() - start:.2f}"
    return seen


@pytest.mark.timeout(60)
def test_faults_26_extra_parameter_unused_parameter_late_rank() -> None:
    r0, r1 = spawn(_faults_job, 2, args=(3.5,), timeout=50, env={"OMP_NUM_THREADS": "1"})
    for seen in (r0, r1):
        assert "rank 0 has 6, rank 1 has 8" in seen["extra"], seen["extra"]
        assert "'extra.weight'" in seen["extra"] and "rank 1" in seen["extra"]
        assert "'fc.weight'" in seen["shape"] and "rank 0" in seen["shape"] and "rank 1" in seen["shape"]
        assert "(4, 4)" in seen["shape"] and "(5, 4)" in seen["shape"]
        assert "'unused.weight'" in seen["unused"] and "'unused.bias'" in seen["unused"]
    assert r0["late"].startswith(DistTimeoutError.__name__) and "rank 1 did not arrive" in r0["late"], r0
    assert 1.9 <= float(r0["late_after"]) <= 3.5
    assert "late" in r1  # the late rank fails too (its peers have moved on), bounded by the timeout


async def test_broadcast_coalesced_buckets_by_dtype_two_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiodist.parallel import _comm

    real = ProcessGroup.collective
    started: dict[int, list[Any]] = {}
    peak: dict[int, int] = {}

    def counting(group: ProcessGroup, name: str, *args: Any, timeout: float | None = None) -> Any:
        # In flight = started on this rank and not completed when the next one starts.
        work = real(group, name, *args, timeout=timeout)
        if name == "broadcast":
            works = started.setdefault(group.rank, [])
            works.append(work)
            peak[group.rank] = max(peak.get(group.rank, 0), sum(not w.is_completed() for w in works))
        return work

    monkeypatch.setattr(ProcessGroup, "collective", counting)  # DDP starts operations on the group

    def tensors(rank: int) -> list[Any]:
        g = torch.Generator().manual_seed(rank)
        out = [torch.randn(n, generator=g) for n in (10, 30, 7, 64, 0, 5)]
        out += [torch.randint(0, 100, (n,), generator=g) for n in (3, 40)]
        out.append(torch.randn(4, 4, generator=g).double())
        return out

    async def rank_fn(group: ProcessGroup) -> Any:
        mine = tensors(group.rank)
        await _comm.broadcast_coalesced(mine, group, src=2, bucket_bytes=128)
        return mine

    results = await run_memory_world(3, rank_fn)
    expected = tensors(2)
    for got in results:
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a, b)
    # several buckets (by dtype, 128 bytes at most), never more than two at a time; the
    # receivers wait for data, so they do hold two
    assert all(len(w) >= 4 for w in started.values())
    assert peak[0] == peak[1] == 2 and peak[2] <= 2


def test_public_names_and_torch_stays_lazy() -> None:
    import subprocess
    import sys

    import aiodist.parallel as parallel

    assert sorted(parallel.__all__) == [
        "DEFAULT_FIRST_BUCKET_BYTES",
        "DistributedDataParallel",
        "GradBucket",
        "GradBucketer",
        "TensorSpec",
        "bucket_size_limits",
        "compute_bucket_assignment_by_size",
        "ddp_buckets",
        "hooks",
        "reverse_order_buckets",
    ]
    for name in parallel.__all__:
        assert getattr(parallel, name) is not None
    code = "import sys, aiodist.parallel; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
