"""Every collective over the in-memory transport: world sizes 1..8, every dtype and reduce op,
every root, sizes 0 / 1 / odd / larger, with both the small-message and the pipelined
large-message algorithms (forced by lowering the switch points). Expected values are derived
from rank and size; integer results are exact, and so are float results whose inputs make
every partial sum exact (AVG on floats is compared with a dtype tolerance)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import aiodist as dist
from aiodist.collectives import select
from aiodist.errors import CollectiveMismatchError, DistTimeoutError, DistTypeError, DistValueError
from aiodist.group import ProcessGroup
from aiodist.ops import SUPPORTED_DTYPE_NAMES, ReduceOp, check_reduce, dtype_from_name
from aiodist.testing import run_memory_world

pytestmark = pytest.mark.timeout(120)

WORLD_SIZES = list(range(1, 9))
SIZES = [0, 1, 7, 333]
INTS = {"uint8", "int8", "int16", "int32", "int64"}
FLOATS = {"float16", "bfloat16", "float32", "float64"}
COMPLEX = {"complex64", "complex128"}


def allowed(op: ReduceOp, name: str) -> bool:
    try:
        check_reduce(op, dtype_from_name(name))
    except DistTypeError:
        return False
    return True


COMBOS = [(name, op) for name in SUPPORTED_DTYPE_NAMES for op in ReduceOp if allowed(op, name)]


@pytest.fixture(params=["small", "large"])
def algo(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """'large' lowers every switch point so that the pipelined algorithms run on tiny buffers,
    with segments of a few elements (many pipeline stages) and reductions in worker threads."""
    if request.param == "large":
        for name in (
            "ALLREDUCE_RING_BYTES",
            "BCAST_CHAIN_BYTES",
            "REDUCE_CHAIN_BYTES",
            "ALLGATHER_RING_BYTES",
            "REDUCE_SCATTER_RING_BYTES",
        ):
            monkeypatch.setattr(select, name, 0)
        monkeypatch.setattr(select, "TREE_GATHER_BYTES", 0)
        monkeypatch.setattr(select, "SEGMENT_BYTES", 256)
        monkeypatch.setattr(select, "RING_SLOTS", 2)
        monkeypatch.setattr(select, "THREAD_REDUCE_BYTES", 512)
        monkeypatch.setattr(select._host, "has_spare_core", lambda: True)  # worker threads whatever the cores
    else:
        monkeypatch.setattr(select, "TREE_GATHER_BYTES", 1 << 40)  # gather/scatter trees, every size here
        monkeypatch.setattr(select, "TREE_GATHER_MIN_RANKS", 2)
    return str(request.param)


async def run(n: int, fn: Callable[[ProcessGroup], Awaitable[Any]]) -> list[Any]:
    return await run_memory_world(n, fn, timeout=60)


# -- data derived from (rank, index) ------------------------------------------------------------
# Every rank of every case computes its inputs and the expected result (which needs every rank's
# inputs): the values are computed once per process and copied or shared read-only from then on
# (they were a quarter of the in-memory tier's time).


def inputs(name: str, op: ReduceOp, rank: int, size: int) -> np.ndarray:
    """Values whose reductions over up to 8 ranks are exact in every dtype (bfloat16 included);
    a fresh array (operations write into it)."""
    return _inputs(name, op, rank, size).copy()


@functools.cache
def _inputs(name: str, op: ReduceOp, rank: int, size: int) -> np.ndarray:
    return _read_only(_compute_inputs(name, op, rank, size))


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _compute_inputs(name: str, op: ReduceOp, rank: int, size: int) -> np.ndarray:
    i = np.arange(size, dtype=np.int64)
    if name == "bool":
        v: np.ndarray = (rank + i) % 3 == 0
        return v
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        v = (rank * 3 + i) % 7 - (0 if name == "uint8" else 3)
    elif op is ReduceOp.PRODUCT:
        table = np.array([1, 2, 3 if name == "uint8" else -1, 1, 1])
        v = table[(rank + i) % 5]
    elif op in (ReduceOp.MIN, ReduceOp.MAX):
        v = (rank * 5 + i * 3) % 11 - (0 if name == "uint8" else 5)
    else:
        v = (rank * 37 + i * 11 + 5) % 256
    if name in COMPLEX:
        return (v + 1j * ((rank + i) % 2)).astype(dtype_from_name(name))
    return (
        v.astype(np.float64).astype(dtype_from_name(name))
        if name in FLOATS
        else v.astype(dtype_from_name(name))
    )


@functools.cache
def expected(name: str, op: ReduceOp, n: int, size: int) -> np.ndarray:
    """What reducing the ``inputs`` of ``n`` ranks gives (read-only)."""
    return _read_only(_compute_expected(name, op, n, size))


def _compute_expected(name: str, op: ReduceOp, n: int, size: int) -> np.ndarray:
    dt = dtype_from_name(name)
    parts = [_inputs(name, op, r, size) for r in range(n)]
    if name in FLOATS:
        parts = [p.astype(np.float64) for p in parts]
    elif name in COMPLEX:
        parts = [p.astype(np.complex128) for p in parts]
    if name == "bool":
        uf = {
            ReduceOp.SUM: np.logical_or,
            ReduceOp.MAX: np.logical_or,
            ReduceOp.BOR: np.logical_or,
            ReduceOp.PRODUCT: np.logical_and,
            ReduceOp.MIN: np.logical_and,
            ReduceOp.BAND: np.logical_and,
            ReduceOp.BXOR: np.logical_xor,
        }[op]
    else:
        uf = {
            ReduceOp.SUM: np.add,
            ReduceOp.AVG: np.add,
            ReduceOp.PRODUCT: np.multiply,
            ReduceOp.MIN: np.minimum,
            ReduceOp.MAX: np.maximum,
            ReduceOp.BAND: np.bitwise_and,
            ReduceOp.BOR: np.bitwise_or,
            ReduceOp.BXOR: np.bitwise_xor,
        }[op]
    acc = parts[0].copy()
    for p in parts[1:]:
        acc = uf(acc, p)
    if op is ReduceOp.AVG:
        if name in INTS:
            s = acc.astype(np.int64)
            acc = np.sign(s) * (np.abs(s) // n)
        else:
            acc = acc / n
    return np.asarray(acc).astype(dt)


def check(name: str, op: ReduceOp, got: np.ndarray, want: np.ndarray, what: str) -> None:
    if op is ReduceOp.AVG and name not in INTS:
        rtol = 1e-2 if name in ("float16", "bfloat16") else 1e-6
        ok = np.allclose(got.astype(np.complex128), want.astype(np.complex128), rtol=rtol, atol=rtol)
    elif name in INTS or name == "bool":
        ok = got.tobytes() == want.tobytes()
    else:  # exact values (-0.0 == 0.0: the sign of a zero product depends on the order)
        ok = got.dtype == want.dtype and bool(np.array_equal(got, want))
    assert ok, f"{what}: got {got[:8]} want {want[:8]}"


def raw(rank: int, tag: int, size: int, name: str) -> np.ndarray:
    """Arbitrary bytes (any bit pattern, NaNs included) as ``size`` elements of dtype ``name``;
    a fresh array."""
    return _raw(rank, tag, size, name).copy()


@functools.cache
def _raw(rank: int, tag: int, size: int, name: str) -> np.ndarray:
    dt = dtype_from_name(name)
    rng = np.random.default_rng(rank * 1000 + tag)
    return np.frombuffer(rng.bytes(size * dt.itemsize), dtype=dt)  # (read-only: over bytes)


# -- reductions -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", WORLD_SIZES)
async def test_all_reduce(n: int, algo: str) -> None:
    async def fn(g: ProcessGroup) -> list[bytes]:
        results = []
        for name, op in COMBOS:
            for size in SIZES:
                t = inputs(name, op, g.rank, size)
                await dist.all_reduce(t, op, group=g)
                check(
                    name, op, t, expected(name, op, n, size), f"all_reduce {name} {op.name} n={n} size={size}"
                )
                results.append(t.tobytes())
        return results

    res = await run(n, fn)
    assert all(r == res[0] for r in res), "ranks ended with different bytes"


@pytest.mark.parametrize("n", WORLD_SIZES)
async def test_all_reduce_identical_bytes_random_floats(n: int, algo: str) -> None:
    """Rounding makes order matter; every rank must still hold the very same bytes."""

    async def fn(g: ProcessGroup) -> list[bytes]:
        out = []
        for name in ("float32", "bfloat16", "float16", "complex64"):
            for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT):
                rng = np.random.default_rng(g.rank)
                t = rng.standard_normal(1001).astype(dtype_from_name(name))
                ref = [np.random.default_rng(r).standard_normal(1001) for r in range(n)]
                await dist.all_reduce(t, op, group=g)
                if op is not ReduceOp.PRODUCT:
                    want = sum(ref) / (n if op is ReduceOp.AVG else 1)
                    assert np.allclose(t.astype(np.complex128), want, rtol=0.05, atol=0.05 * n)
                out.append(t.tobytes())
        t = np.array([0.0, -0.0, np.nan], np.float32) * (1 if g.rank % 2 else -1)
        await dist.all_reduce(t, ReduceOp.MIN, group=g)
        out.append(t.tobytes())
        return out

    res = await run(n, fn)
    assert all(r == res[0] for r in res)


@pytest.mark.parametrize("n", WORLD_SIZES)
async def test_reduce_every_root(n: int, algo: str) -> None:
    async def fn(g: ProcessGroup) -> None:
        for k, (name, op) in enumerate(COMBOS):
            for size in SIZES:
                root = (k + size) % n
                t = inputs(name, op, g.rank, size)
                before = t.copy()
                await dist.reduce(t, root, op, group=g)
                if g.rank == root:
                    check(name, op, t, expected(name, op, n, size), f"reduce {name} {op.name} root {root}")
                else:
                    assert t.tobytes() == before.tobytes(), "reduce wrote a non-root buffer"
        for root in range(n):  # every root, one combination
            t = inputs("int32", ReduceOp.SUM, g.rank, 1000)
            await dist.reduce(t, root, group=g)
            if g.rank == root:
                check(
                    "int32", ReduceOp.SUM, t, expected("int32", ReduceOp.SUM, n, 1000), f"reduce root {root}"
                )

    await run(n, fn)


@pytest.mark.parametrize("n", WORLD_SIZES)
async def test_reduce_scatter(n: int, algo: str) -> None:
    async def fn(g: ProcessGroup) -> None:
        for k, (name, op) in enumerate(COMBOS):
            for size in SIZES:
                full = inputs(name, op, g.rank, size * n)
                want = expected(name, op, n, size * n)[g.rank * size : (g.rank + 1) * size]
                out = np.zeros(size, full.dtype)
                await dist.reduce_scatter_tensor(out, full, op, group=g)
                check(name, op, out, want, f"reduce_scatter_tensor {name} {op.name} size {size}")
                if k % 3:
                    continue  # the list form runs the same algorithm: a third of the combinations
                out2 = np.zeros(size, full.dtype)
                await dist.reduce_scatter(
                    out2, [full[i * size : (i + 1) * size].copy() for i in range(n)], op, group=g
                )
                check(name, op, out2, want, f"reduce_scatter {name} {op.name} size {size}")

    await run(n, fn)


# -- data movement ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", WORLD_SIZES)
async def test_broadcast_every_root(n: int, algo: str) -> None:
    async def fn(g: ProcessGroup) -> None:
        for k, name in enumerate(SUPPORTED_DTYPE_NAMES):
            for size in [*SIZES, 5000]:
                for root in range(n) if size == 7 else [(k + size) % n]:
                    t = raw(g.rank, k, size, name)
                    await dist.broadcast(t, root, group=g)
                    assert t.tobytes() == raw(root, k, size, name).tobytes(), (name, size, root)

    await run(n, fn)


@pytest.mark.parametrize("n", WORLD_SIZES)
async def test_all_gather(n: int, algo: str) -> None:
    async def fn(g: ProcessGroup) -> None:
        for k, name in enumerate(SUPPORTED_DTYPE_NAMES):
            for size in SIZES:
                mine = raw(g.rank, k, size, name)
                outs = [np.zeros(size, mine.dtype) for _ in range(n)]
                await dist.all_gather(outs, mine, group=g)
                for i in range(n):
                    assert outs[i].tobytes() == raw(i, k, size, name).tobytes(), (name, size, i)
                flat = np.zeros(size * n, mine.dtype)
                await dist.all_gather_into_tensor(flat, mine, group=g)
                assert flat.tobytes() == b"".join(raw(i, k, size, name).tobytes() for i in range(n))
                # in place: the input is this rank's block of the output
                flat2 = np.zeros(size * n, mine.dtype)
                flat2[g.rank * size : (g.rank + 1) * size] = mine
                await dist.all_gather_single(flat2, flat2[g.rank * size : (g.rank + 1) * size], group=g)
                assert flat2.tobytes() == flat.tobytes()

    await run(n, fn)


@pytest.mark.parametrize("n", WORLD_SIZES)
async def test_gather_scatter_every_root(n: int, algo: str) -> None:
    async def fn(g: ProcessGroup) -> None:
        for k, name in enumerate(SUPPORTED_DTYPE_NAMES):
            for size in SIZES:
                for root in range(n) if size == 7 else [(k + size) % n]:
                    mine = raw(g.rank, k, size, name)
                    outs = [np.zeros(size, mine.dtype) for _ in range(n)] if g.rank == root else None
                    await dist.gather(mine, outs, root, group=g)
                    if outs is not None:
                        for i in range(n):
                            assert outs[i].tobytes() == raw(i, k, size, name).tobytes(), (
                                "gather",
                                name,
                                size,
                                root,
                            )
                    ins = [raw(100 + i, k, size, name) for i in range(n)] if g.rank == root else None
                    out = np.zeros(size, mine.dtype)
                    await dist.scatter(out, ins, root, group=g)
                    assert out.tobytes() == raw(100 + g.rank, k, size, name).tobytes(), (
                        "scatter",
                        name,
                        size,
                        root,
                    )

    await run(n, fn)


@pytest.mark.parametrize("n", WORLD_SIZES)
async def test_all_to_all_even_and_uneven(n: int, algo: str) -> None:
    def block(src: int, dst: int, rows: int, k: int) -> np.ndarray:
        return (np.arange(rows * 3, dtype=np.int64) + 1000 * src + 100000 * dst + k).reshape(rows, 3)

    async def fn(g: ProcessGroup) -> None:
        r = g.rank
        for k, (rows_of) in enumerate([lambda s, d: 2, lambda s, d: (s + 2 * d) % 4, lambda s, d: 0]):
            ins = [block(r, d, rows_of(r, d), k) for d in range(n)]
            outs = [np.zeros((rows_of(s, r), 3), np.int64) for s in range(n)]
            await dist.all_to_all(outs, ins, group=g)
            for s in range(n):
                assert np.array_equal(outs[s], block(s, r, rows_of(s, r), k))
            inp = np.concatenate(ins) if n else ins[0]
            out = np.zeros((sum(rows_of(s, r) for s in range(n)), 3), np.int64)
            even = k == 0
            await dist.all_to_all_single(
                out,
                inp,
                None if even else [rows_of(s, r) for s in range(n)],
                None if even else [rows_of(r, d) for d in range(n)],
                group=g,
            )
            assert np.array_equal(out, np.concatenate([block(s, r, rows_of(s, r), k) for s in range(n)]))
        for name in ("bfloat16", "complex128", "bool"):
            ins = [raw(r * 10 + d, 7, 3, name) for d in range(n)]
            outs = [np.zeros(3, ins[0].dtype) for _ in range(n)]
            await dist.all_to_all(outs, ins, group=g)
            assert all(outs[s].tobytes() == raw(s * 10 + r, 7, 3, name).tobytes() for s in range(n))

    await run(n, fn)


# -- a few large buffers with the default switch points ---------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 5])
async def test_large_buffers(n: int) -> None:
    size = 3 * (1 << 20) // 4 + 1  # 3 MiB of float32, odd
    ints = size // 2

    async def fn(g: ProcessGroup) -> bytes:
        r = g.rank
        t = np.full(size, r + 1, np.float32)
        t[::7] = r * 0.5
        await dist.all_reduce(t, group=g)
        want = np.full(size, n * (n + 1) / 2, np.float32)
        want[::7] = sum(range(n)) * 0.5
        assert np.array_equal(t, want)
        a = np.arange(ints, dtype=np.int64) * (r + 1)
        await dist.all_reduce(a, ReduceOp.AVG, group=g)
        assert np.array_equal(a, np.arange(ints, dtype=np.int64) * (n + 1) // 2)
        b = np.arange(ints, dtype=np.int64) if r == n - 1 else np.zeros(ints, np.int64)
        await dist.broadcast(b, n - 1, group=g)
        assert np.array_equal(b, np.arange(ints))
        c = np.arange(ints, dtype=np.int32) + r
        await dist.reduce(c, 1 % n, ReduceOp.MAX, group=g)
        if r == 1 % n:
            assert np.array_equal(c, np.arange(ints, dtype=np.int32) + n - 1)
        per = (1 << 20) // 8
        outs = np.zeros(per * n, np.float64)
        await dist.all_gather_into_tensor(outs, np.full(per, r, np.float64), group=g)
        assert np.array_equal(outs, np.repeat(np.arange(n, dtype=np.float64), per))
        rs = np.zeros(per, np.float64)
        await dist.reduce_scatter_tensor(rs, np.tile(np.arange(per, dtype=np.float64), n) + r, group=g)
        assert np.array_equal(rs, np.arange(per) * n + n * (n - 1) / 2)
        return t.tobytes()

    res = await run(n, fn)
    assert all(x == res[0] for x in res)


# -- many operations in flight ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [3, 4, 7])
async def test_many_in_flight_mixed(n: int) -> None:
    async def fn(g: ProcessGroup) -> None:
        r = g.rank
        bufs = [np.full(s, r + 1, np.int64) for s in (0, 1, 10, 1000, 100_000) * 6]
        ops = [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT, ReduceOp.BXOR]
        works = [dist.all_reduce(b, ops[i % len(ops)], group=g) for i, b in enumerate(bufs)]
        bc = np.full(5000, r, np.float32)
        works.append(dist.broadcast(bc, n - 1, group=g))
        outs = [np.zeros(4, np.int16) for _ in range(n)]
        works.append(dist.all_gather(outs, np.full(4, r, np.int16), group=g))
        p2p = np.zeros(3, np.int32)
        works.append(g.send(np.full(3, r, np.int32), (r + 1) % n))
        works.append(g.recv(p2p, (r - 1) % n))
        await asyncio.gather(*works)
        fold = {
            ReduceOp.SUM: n * (n + 1) // 2,
            ReduceOp.MAX: n,
            ReduceOp.MIN: 1,
            ReduceOp.PRODUCT: int(np.prod(np.arange(1, n + 1))),
            ReduceOp.BXOR: int(np.bitwise_xor.reduce(np.arange(1, n + 1))),
        }
        for i, b in enumerate(bufs):
            assert (b == fold[ops[i % len(ops)]]).all()
        assert (bc == n - 1).all()
        assert all((outs[i] == i).all() for i in range(n))
        assert (p2p == (r - 1) % n).all()

    await run(n, fn)


async def test_two_groups_busy_at_once() -> None:
    async def fn(g: ProcessGroup) -> None:
        sub_ranks = [1, 3, 4]
        sub = ProcessGroup(g.transport, sub_ranks, 7, timeout=30)
        a = np.full(100, g.rank, np.int64)
        works = [dist.all_reduce(a, group=g)]
        b = np.full(100, g.rank, np.int64)
        if sub.rank >= 0:
            works.append(dist.all_reduce(b, group=sub))
            c = np.zeros(5, np.int32) if g.rank != 4 else np.arange(5, dtype=np.int32)
            works.append(dist.broadcast(c, 4, group=sub))  # src is a global rank
        else:
            with pytest.raises(DistValueError, match="not a member"):
                dist.all_reduce(b, group=sub)
        await asyncio.gather(*works)
        assert (a == sum(range(5))).all()
        if sub.rank >= 0:
            assert (b == sum(sub_ranks)).all()
            assert np.array_equal(c, np.arange(5))

    await run(5, fn)


# -- mismatches and the DETAIL mode --------------------------------------------------------------------------


async def _expect_both(n: int, call: Callable[[ProcessGroup], Any], exc: type[BaseException]) -> list[str]:
    async def fn(g: ProcessGroup) -> str:
        with pytest.raises(exc) as info:
            await call(g)
        return str(info.value)

    return await run(n, fn)


async def test_mismatch_op_size_dtype_root() -> None:
    msgs = await _expect_both(
        2,
        lambda g: (
            dist.all_reduce(np.zeros(10, np.float32), group=g)
            if g.rank == 0
            else dist.broadcast(np.zeros(10, np.float32), 0, group=g)
        ),
        CollectiveMismatchError,
    )
    assert any("all_reduce" in m and "broadcast" in m for m in msgs)
    msgs = await _expect_both(
        2, lambda g: dist.all_reduce(np.zeros(10 + 10 * g.rank, np.float32), group=g), CollectiveMismatchError
    )
    assert all("x 10" in m and "x 20" in m for m in msgs)
    await _expect_both(
        2,
        lambda g: dist.all_reduce(np.zeros(10, np.float32 if g.rank else np.float64), group=g),
        CollectiveMismatchError,
    )
    await _expect_both(
        2,
        lambda g: dist.all_reduce(np.zeros(4), ReduceOp.MAX if g.rank else ReduceOp.SUM, group=g),
        CollectiveMismatchError,
    )

    async def after(g: ProcessGroup) -> None:
        # A mismatch fails that operation (and, by the group's policy, may break its group);
        # the process and its other groups go on.
        sub = ProcessGroup(g.transport, [0, 1], 5, timeout=30)
        with pytest.raises(CollectiveMismatchError):
            await dist.all_reduce(np.zeros(1 + g.rank), group=sub)
        t = np.full(3, g.rank + 1, np.int64)
        await dist.all_reduce(t, group=g)
        assert (t == 3).all()

    await run(2, after)


async def test_uneven_all_to_all_size_disagreement() -> None:
    async def fn(g: ProcessGroup) -> str:
        if g.rank == 0:  # expects 2 elements from rank 1, which sends 1
            with pytest.raises(CollectiveMismatchError) as info:
                await dist.all_to_all_single(
                    np.zeros(4, np.int32), np.zeros(4, np.int32), [2, 2], [2, 2], group=g
                )
            return str(info.value)
        try:
            await dist.all_to_all_single(
                np.zeros(5, np.int32), np.zeros(4, np.int32), [2, 3], [1, 3], group=g
            )
        except CollectiveMismatchError as exc:  # told by rank 0 if still in flight
            return str(exc)
        return ""

    msgs = await run(2, fn)
    assert "rank 1 sent 4 bytes" in msgs[0] and "8 bytes" in msgs[0]


async def test_detail_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIODIST_DEBUG", "DETAIL")

    async def fn(g: ProcessGroup) -> str:
        t = np.ones(8, np.float32)
        await dist.all_reduce(t, group=g)  # agreement passes
        assert (t == g.size).all()
        with pytest.raises(CollectiveMismatchError) as info:
            if g.rank == 2:
                await dist.broadcast(np.zeros(8, np.float32), 0, group=g)
            else:
                await dist.all_reduce(np.zeros(8, np.float32), group=g)
        return str(info.value)

    msgs = await run(4, fn)
    for m in msgs:
        assert "rank 2: broadcast" in m and "ranks 0, 1, 3: all_reduce" in m

    async def roots(g: ProcessGroup) -> None:
        # Two ranks that both believe they are the root never receive anything: only the
        # explicit check can see it.
        with pytest.raises(CollectiveMismatchError, match=r"root 0.*root 1|root 1.*root 0"):
            await dist.broadcast(np.zeros(3, np.int8), g.rank, group=g)

    await run(2, roots)

    async def missing(g: ProcessGroup) -> str:
        g.timeout = 0.5
        if g.rank == 1:
            await asyncio.sleep(0.7)
            return ""
        with pytest.raises(DistTimeoutError) as info:
            await dist.all_reduce(np.zeros(4), group=g)
        return str(info.value)

    msgs = await run(3, missing)
    assert "rank 1 did not reach" in msgs[0] and "rank 1 did not reach" in msgs[2]


# -- argument validation -----------------------------------------------------------------------------------


async def test_validation_errors() -> None:
    async def fn(g: ProcessGroup) -> None:
        f = np.zeros(4, np.float32)
        with pytest.raises(DistTypeError, match="BXOR"):
            dist.all_reduce(f, ReduceOp.BXOR, group=g)
        with pytest.raises(DistTypeError, match="complex"):
            dist.all_reduce(np.zeros(2, np.complex64), ReduceOp.MIN, group=g)
        with pytest.raises(DistTypeError, match="AVG"):
            dist.all_reduce(np.zeros(2, bool), ReduceOp.AVG, group=g)
        ro = np.zeros(4, np.float32)
        ro.flags.writeable = False
        with pytest.raises(DistValueError, match="read-only"):
            dist.all_reduce(ro, group=g)
        with pytest.raises(DistValueError, match="tensor_list must have one tensor per group member"):
            dist.all_gather([f], f, group=g)
        with pytest.raises(DistTypeError, match=r"tensor_list\[1\] has dtype float64"):
            dist.all_gather([f, np.zeros(4)], f, group=g)
        with pytest.raises(DistValueError, match=r"tensor_list\[0\] has 3 elements"):
            dist.all_gather([np.zeros(3, np.float32), f], f, group=g)
        with pytest.raises(DistValueError, match="output_tensor has 4 elements"):
            dist.all_gather_into_tensor(f, f, group=g)
        with pytest.raises(DistValueError, match="src=5 is not a member"):
            dist.broadcast(f, 5, group=g)
        with pytest.raises(DistValueError, match="dst=-1"):
            dist.reduce(f, -1, group=g)
        with pytest.raises(DistValueError, match="gather_list is required"):
            dist.gather(f, None, g.rank, group=g)
        with pytest.raises(DistValueError, match="must not be given"):
            dist.scatter(f, [f, f], 1 - g.rank, group=g)
        with pytest.raises(DistValueError, match="input_split_sizes sums to 3"):
            dist.all_to_all_single(f, f, None, [1, 2], group=g)
        with pytest.raises(DistValueError, match="cannot be split evenly"):
            dist.all_to_all_single(np.zeros(3), np.zeros(3), group=g)
        with pytest.raises(DistValueError, match="input has 4 elements"):
            dist.reduce_scatter_tensor(f, f, group=g)
        with pytest.raises(DistTypeError, match=r"numpy\.ndarray or a torch\.Tensor"):
            dist.broadcast([1, 2], 0, group=g)
        # refused calls took no sequence number: the next call still matches across ranks
        t = np.ones(3, np.int16)
        await dist.all_reduce(t, group=g)
        assert (t == 2).all()

    await run(2, fn)


async def test_bfloat16_is_ml_dtypes() -> None:
    async def fn(g: ProcessGroup) -> None:
        t = np.array([1.5, 2.0, -3.0], dtype=ml_dtypes.bfloat16)
        await dist.all_reduce(t, ReduceOp.MAX, group=g)
        assert t.dtype == ml_dtypes.bfloat16 and t.astype(np.float32).tolist() == [1.5, 2.0, -3.0]

    await run(3, fn)


async def test_root_disagreement_is_not_silent() -> None:
    """Two ranks that both believe they are a broadcast's root only send, so no receive ever
    meets the other's data; the late data still surfaces as a CollectiveMismatchError."""
    import aiodist as _dist
    from aiodist.group import ProcessGroup as _PG

    async def fn(g: _PG) -> str:
        buf = np.full(4, g.rank, np.float32)
        try:
            await _dist.broadcast(buf, src=g.rank, group=g)  # each names itself as root
            await asyncio.sleep(0.05)
            await _dist.barrier(group=g)
        except _dist.CollectiveMismatchError as exc:
            return str(exc)
        return "silent"

    res = await run_memory_world(2, fn)
    assert all("disagree" in r for r in res), res
