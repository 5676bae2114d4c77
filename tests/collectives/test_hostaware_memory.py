"""Host-aware collectives over the in-memory transport, with fabricated host maps.

The ranks are tasks of one loop; each transport is told which "host" every rank is on, as the
mesh tells it at rendezvous. Layouts: two hosts of two ranks (and pairs for other sizes), hosts
of uneven sizes (3 + 1), hosts whose ranks interleave (0, 2, 4 | 1, 3), one rank per host (the
flat algorithms), and one host with the direct algorithms forced. Every operation, dtype and
reduce op, sizes 0 / 1 / odd / larger, every root; results derived from rank and size, and
the log says which path ran.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from test_collectives_memory import COMBOS, SIZES, check, expected, inputs, raw

import aiodist as dist
from aiodist.collectives import select
from aiodist.collectives.context import OpContext
from aiodist.collectives.topology import host_map
from aiodist.group import ProcessGroup
from aiodist.ops import SUPPORTED_DTYPE_NAMES, ReduceOp, dtype_from_name
from aiodist.settings import Settings
from aiodist.testing import run_memory_world
from aiodist.transport import mesh
from aiodist.transport.memory import MemoryTransport

pytestmark = pytest.mark.timeout(120)

LAYOUTS: dict[str, Callable[[int], list[str]]] = {
    "pairs": lambda n: [f"h{r // 2}" for r in range(n)],
    "uneven": lambda n: ["a"] * (n - 1) + ["b"],
    "interleaved": lambda n: [f"h{r % 2}" for r in range(n)],
    "one-per-host": lambda n: [f"h{r}" for r in range(n)],
    "one-host-direct": lambda n: ["h"] * n,
    # Shared memory on each host: the automatic choice runs the direct forms inside hosts.
    "one-host-shm": lambda n: ["h"] * n,
    "pairs-shm": lambda n: [f"h{r // 2}" for r in range(n)],
    "triples-shm": lambda n: [f"h{r // 3}" for r in range(n)],
    "subgroups": lambda n: ["a", "a", "b", "b", "b"],
}
# (layout, world size): 2 x 2, 3 + 1 and the others at a few sizes, odd ones included; the
# direct algorithms at every size 1..8 (the full grid of dtypes and ops at 3 and 4, a quarter
# of it elsewhere: the algorithms move bytes alike whatever the dtype).
CASES = [
    ("pairs", 4),
    ("pairs", 5),
    ("pairs", 8),
    ("uneven", 4),
    ("uneven", 3),
    ("interleaved", 5),
    ("one-per-host", 3),
    ("one-host-shm", 3),
    ("pairs-shm", 6),
    ("pairs-shm", 4),
    ("triples-shm", 6),
    *(("one-host-direct", n) for n in range(1, 9)),
]
FULL_GRID = {3, 4}


@pytest.fixture(params=["small", "large"])
def algo(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """'large' lowers the switch points: the pipelined algorithms and the direct all_reduce run on
    tiny buffers, cut into segments of a few elements, reductions in worker threads."""
    if request.param == "large":
        for name in (
            "ALLREDUCE_RING_BYTES",
            "BCAST_CHAIN_BYTES",
            "REDUCE_CHAIN_BYTES",
            "ALLGATHER_RING_BYTES",
            "REDUCE_SCATTER_RING_BYTES",
            "DIRECT_ALLREDUCE_BYTES",
        ):
            monkeypatch.setattr(select, name, 0)
        monkeypatch.setattr(select, "SEGMENT_BYTES", 256)
        monkeypatch.setattr(select, "TWO_LEVEL_CHUNK_BYTES", 96)  # the two-level forms in many chunks
        monkeypatch.setattr(select, "RING_SLOTS", 2)
        monkeypatch.setattr(select, "THREAD_REDUCE_BYTES", 512)
        monkeypatch.setattr(select._host, "has_spare_core", lambda: True)
    return str(request.param)


async def run(n: int, layout: str, fn: Callable[[ProcessGroup], Awaitable[Any]]) -> list[Any]:
    return await run_memory_world(
        n,
        fn,
        timeout=60,
        hosts=LAYOUTS[layout](n),
        shared_memory=layout.endswith("-shm"),
        host_algos="direct" if layout == "one-host-direct" else "auto",
    )


def expected_path(layout: str, n: int, algo: str, op: str = "broadcast") -> str | None:
    """The word the log says for this layout's host-aware operation ``op`` (None: none runs):
    over several hosts, the phases for small buffers; for large ones the two-level forms of
    all_reduce, all_gather and reduce_scatter where every host has as many ranks sharing memory,
    else the flat rings and chains in host order."""
    if layout in ("one-host-direct", "one-host-shm"):
        return "direct" if n > 1 else None
    hosts = LAYOUTS[layout](n)
    if layout == "one-per-host" or len(set(hosts)) in (1, n):
        return None
    uniform = len({hosts.count(h) for h in hosts}) == 1
    if algo == "large" and uniform and layout.endswith("-shm") and op in ("all_reduce", "all_gather"):
        return "two-level"
    return "hierarchical" if algo == "small" else "host-ordered"


# -- the host map and the choice -------------------------------------------------------------------


def test_host_map_groups_ranks_by_host_and_leads_with_the_lowest() -> None:
    keys = ("b", "a", "b", "c", "a")
    m = host_map(keys, range(5))
    assert m is not None
    assert m.members == ((0, 2), (1, 4), (3,))
    assert m.leaders == (0, 1, 3)
    assert m.host_of == (0, 1, 0, 2, 1)
    assert m.layered and not m.one_host and not m.contiguous()
    sub = host_map(keys, [4, 2, 1])  # a subgroup gets its own map, in its own rank order
    assert sub is not None and sub.members == ((0, 2), (1,)) and sub.leaders == (0, 1)
    assert host_map(keys, [1, 4]).one_host  # type: ignore[union-attr]
    assert not host_map(keys, [0, 1, 3]).layered  # type: ignore[union-attr]  # one rank per host
    assert host_map(None, range(5)) is None


def _ctx(keys: tuple[str, ...] | None, rank: int = 0) -> OpContext:
    """A context of rank ``rank`` in a group laid out over ``keys`` (nothing is sent)."""
    loop = asyncio.new_event_loop()
    try:
        t = MemoryTransport(None, rank, len(keys or "ab"), loop)  # type: ignore[arg-type]
        t.host_keys = keys
        return OpContext(t, range(t.world_size), rank, (0, 0, 0), None)
    finally:
        loop.close()


def test_choice_follows_the_layout_and_the_switch() -> None:
    big = 64 << 20
    layered = _ctx(("a", "a", "b", "b"))
    for op in ("all_reduce", "broadcast", "all_gather", "reduce", "barrier"):
        assert select.host_algorithm(op, big, layered) == "hierarchical"
    for op in ("all_to_all", "reduce_scatter", "gather", "scatter"):
        assert select.host_algorithm(op, big, layered) == "flat"
    # The same number of ranks on every host, sharing memory: large reductions and gathers in two levels.
    layered.transport.shm_local = (True,) * 4
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        assert select.host_algorithm(op, big, layered) == "two-level"
        assert select.host_algorithm(op, 4, layered) != "two-level"  # small: the phases, or flat
    assert select.host_algorithm("broadcast", big, layered) == "hierarchical"  # (its chain in host order)
    uneven = _ctx(("a", "a", "a", "b"))
    uneven.transport.shm_local = (True,) * 4
    assert select.host_algorithm("all_reduce", big, uneven) == "hierarchical"
    layered.transport.shm_local = None
    assert select.host_algorithm("all_reduce", big, _ctx(("a", "b", "c"))) == "flat"
    assert select.host_algorithm("all_reduce", big, _ctx(None)) == "flat"
    one = _ctx(("a", "a", "a"))
    assert select.host_algorithm("all_reduce", big, one) == "flat"  # no shared memory here
    one.transport.shm_local = (True, True, True)
    assert select.host_algorithm("all_reduce", big, one) == "direct"
    assert select.host_algorithm("all_reduce", 4, one) == "flat"  # small: recursive doubling
    assert select.host_algorithm("all_to_all", big, one) == "flat"  # pairwise already
    for ctx in (layered, one):
        ctx.transport.host_algos = "flat"
    assert select.host_algorithm("all_reduce", big, layered) == "flat"
    assert select.host_algorithm("all_reduce", big, one) == "flat"
    one.transport.shm_local = None
    one.transport.host_algos = "direct"
    assert select.host_algorithm("broadcast", big, one) == "direct"  # whatever carries the data


def test_the_switch_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(select.HOST_ALGOS_ENV, "Direct ")
    assert Settings.read().checked_host_algos() == "direct"
    monkeypatch.setenv(select.HOST_ALGOS_ENV, "bogus")
    with pytest.raises(ValueError, match="AIODIST_HOST_ALGOS='bogus': use one of auto, flat, direct"):
        Settings.read().checked_host_algos()


# -- every operation, every layout ------------------------------------------------------------------


@pytest.mark.parametrize(("layout", "n"), CASES)
async def test_reductions(
    layout: str, n: int, algo: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    combos = COMBOS if n in FULL_GRID else COMBOS[::4]

    async def fn(g: ProcessGroup) -> list[bytes]:
        out = []
        for k, (name, op) in enumerate(combos):
            for size in SIZES:
                want = expected(name, op, n, size)
                t = inputs(name, op, g.rank, size)
                await dist.all_reduce(t, op, group=g)
                check(name, op, t, want, f"all_reduce {name} {op.name} n={n} size={size}")
                out.append(t.tobytes())
                if k % 2:
                    continue  # reduce and reduce_scatter: half the combinations
                root = (k + size) % n
                t = inputs(name, op, g.rank, size)
                before = t.copy()
                await dist.reduce(t, root, op, group=g)
                if g.rank == root:
                    check(name, op, t, want, f"reduce {name} {op.name} root {root}")
                else:
                    assert t.tobytes() == before.tobytes(), "reduce wrote a non-root buffer"
                full = inputs(name, op, g.rank, size * n)
                part = np.zeros(size, full.dtype)
                await dist.reduce_scatter_tensor(part, full, op, group=g)
                want_rs = expected(name, op, n, size * n)[g.rank * size : (g.rank + 1) * size]
                check(name, op, part, want_rs, f"reduce_scatter {name} {op.name} size {size}")
        for root in range(n):  # every root
            t = inputs("int32", ReduceOp.SUM, g.rank, 1000)
            await dist.reduce(t, root, group=g)
            if g.rank == root:
                check("int32", ReduceOp.SUM, t, expected("int32", ReduceOp.SUM, n, 1000), f"root {root}")
        # Rounding makes the order matter: every rank must still end with the same bytes.
        for name in ("float32", "bfloat16", "complex64"):
            t = np.random.default_rng(g.rank).standard_normal(1001).astype(dtype_from_name(name))
            await dist.all_reduce(t, ReduceOp.AVG, group=g)
            out.append(t.tobytes())
        return out

    with caplog.at_level(logging.DEBUG, logger="aiodist"):
        res = await run(n, layout, fn)
    assert all(r == res[0] for r in res), "ranks ended with different bytes"
    path = expected_path(layout, n, algo)
    said = caplog.text
    if path is None:
        assert not re.search(" (hierarchical|host-ordered|direct) ", said)
    elif path == "direct":
        assert "reduce_scatter_tensor #2: reduce_scatter direct" in said
        assert ("all_reduce #0: all_reduce direct" in said) == (algo == "large")  # small: recursive doubling
    else:
        reduced = expected_path(layout, n, algo, "all_reduce")
        assert f"all_reduce #0: all_reduce {reduced}" in said and f"reduce #1: reduce {path}" in said
        if reduced == "two-level":
            assert "reduce_scatter_tensor #2: reduce_scatter two-level" in said
        # Inside each host: the direct forms where the host has shared memory, else the flat ones.
        local_direct = "all_reduce #0: broadcast direct on one host" in said
        assert local_direct == (layout.endswith("-shm") and path == "hierarchical")


@pytest.mark.parametrize(("layout", "n"), CASES)
async def test_data_movement(
    layout: str, n: int, algo: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:

    names = SUPPORTED_DTYPE_NAMES if n in FULL_GRID else SUPPORTED_DTYPE_NAMES[::4]

    async def fn(g: ProcessGroup) -> None:
        r = g.rank
        for k, name in enumerate(names):
            for size in [*SIZES, 5000]:
                for root in range(n) if size == 7 else [(k + size) % n]:
                    t = raw(r, k, size, name)
                    await dist.broadcast(t, root, group=g)
                    assert t.tobytes() == raw(root, k, size, name).tobytes(), (name, size, root)
                mine = raw(r, k, size, name)
                outs = [np.zeros(size, mine.dtype) for _ in range(n)]
                await dist.all_gather(outs, mine, group=g)
                for i in range(n):
                    assert outs[i].tobytes() == raw(i, k, size, name).tobytes(), (name, size, i)
                flat = np.zeros(size * n, mine.dtype)
                await dist.all_gather_into_tensor(flat, mine, group=g)
                assert flat.tobytes() == b"".join(raw(i, k, size, name).tobytes() for i in range(n))
                flat2 = np.zeros(size * n, mine.dtype)
                flat2[r * size : (r + 1) * size] = mine
                await dist.all_gather_single(flat2, flat2[r * size : (r + 1) * size], group=g)
                assert flat2.tobytes() == flat.tobytes()
        # Blocks of different sizes (all_gather of objects sends such lists).
        objs: list[Any] = [None] * n
        await dist.all_gather_object(objs, {"rank": r, "pad": "x" * (r * 37)}, group=g)
        assert objs == [{"rank": i, "pad": "x" * (i * 37)} for i in range(n)]
        got: list[Any] = [f"from {r}" if r == n - 1 else None]
        await dist.broadcast_object_list(got, n - 1, group=g)
        assert got == [f"from {n - 1}"]
        # The operations without a host-aware form still run on a group laid out over hosts.
        ins = [np.full(3, 100 * r + d, np.int64) for d in range(n)]
        outs64 = [np.zeros(3, np.int64) for _ in range(n)]
        await dist.all_to_all(outs64, ins, group=g)
        assert all((outs64[s] == 100 * s + r).all() for s in range(n))
        gathered = [np.zeros(2, np.int16) for _ in range(n)] if r == 0 else None
        await dist.gather(np.full(2, r, np.int16), gathered, 0, group=g)
        if gathered is not None:
            assert all((gathered[i] == i).all() for i in range(n))
        for _ in range(3):
            await dist.barrier(group=g)

    with caplog.at_level(logging.DEBUG, logger="aiodist"):
        await run(n, layout, fn)
    path = expected_path(layout, n, algo)
    if path is not None:
        assert f"broadcast #0: broadcast {path}" in caplog.text
        assert f"all_gather #1: all_gather {expected_path(layout, n, algo, 'all_gather')}" in caplog.text


@pytest.mark.parametrize("sub_ranks", [[1, 2, 4], [0, 1], [3, 1, 2, 0]])
async def test_subgroups_get_their_own_layout(sub_ranks: list[int]) -> None:
    """Hosts a, a, b, b, b: a subgroup across hosts runs hierarchical on its own map, one inside a
    host runs flat (no shared memory here), and both at once with the whole group."""
    n = 5

    async def fn(g: ProcessGroup) -> None:
        sub = ProcessGroup(g.transport, sub_ranks, 9, timeout=30)
        a = np.full(1000, g.rank, np.int64)
        works = [dist.all_reduce(a, group=g)]
        if sub.rank >= 0:
            b = np.full(1000, g.rank + 1, np.float64)
            works.append(dist.all_reduce(b, ReduceOp.AVG, group=sub))
            c = np.arange(11, dtype=np.int32) if g.rank == sub_ranks[-1] else np.zeros(11, np.int32)
            works.append(dist.broadcast(c, sub_ranks[-1], group=sub))
        for w in works:
            await w
        assert (a == sum(range(n))).all()
        if sub.rank >= 0:
            assert np.allclose(b, sum(r + 1 for r in sub_ranks) / len(sub_ranks))
            assert np.array_equal(c, np.arange(11))
            await dist.barrier(group=sub)

    await run(n, "subgroups", fn)


# -- the host facts the rendezvous agrees on ---------------------------------------------------------


async def _agree(store: Any, t: Any, deadline: Any, mode: str) -> None:
    """Rank 0's roster, then the host map, as a rank's rendezvous reads them."""
    await store.set(f"addr/{t.rank}", f"127.0.0.1:{1000 + t.rank}")
    roster = await mesh._roster(store, t.rank, t.world_size, deadline, mesh._Seen())
    assert roster.address(t.rank) == ("127.0.0.1", 1000 + t.rank)
    await mesh._agree_hosts(store, t, roster, deadline, mesh._Seen(), mode)


async def test_rendezvous_agrees_on_hosts_and_shared_memory() -> None:
    """Hosts a, a, a, b; rank 2 reaches rank 0 but not rank 1 through shared memory. Every rank
    ends with the same facts: ranks 0 and 1 share memory with all of their host, 2 does not, 3
    has nobody to share with; a rank of an older version (no host id) counts as its own host."""
    from aiodist.store.memory import HashStore
    from aiodist.transport.memory import MemoryFabric

    store = HashStore()
    fabric = MemoryFabric(5)
    hosts = ["a", "a", "a", "b", ""]
    local = {0: [1, 2], 1: [0, 2], 2: [0], 3: [], 4: []}
    for r, t in enumerate(fabric.transports):
        await store.set(f"claimant/{r}/1", mesh.Identity(r, 5, "box", 100 + r, host_id=hosts[r]).encode())
        t.local_peers = lambda r=r: local[r]  # type: ignore[method-assign]
    deadline = mesh._Deadline(10)
    await asyncio.gather(*(_agree(store, t, deadline, "direct") for t in fabric.transports))
    for t in fabric.transports:
        assert t.host_keys == ("a", "a", "a", "b", "rank:4")
        assert t.shm_local == (True, True, False, False, False)
        assert t.host_algos == "direct"
    for t in fabric.transports:
        t.abort()
    m = host_map(fabric.transports[0].host_keys, range(5))
    assert m is not None and m.members == ((0, 1, 2), (3,), (4,)) and m.layered


async def test_rendezvous_refuses_ranks_that_disagree_on_the_switch() -> None:
    from aiodist.errors import DistError
    from aiodist.store.memory import HashStore
    from aiodist.transport.memory import MemoryFabric

    store = HashStore()
    fabric = MemoryFabric(3)
    for r in range(3):
        await store.set(f"claimant/{r}/1", mesh.Identity(r, 3, "box", 100 + r, host_id="a").encode())
    deadline = mesh._Deadline(10)
    modes = ["auto", "flat", "auto"]
    got = await asyncio.gather(
        *(_agree(store, t, deadline, m) for t, m in zip(fabric.transports, modes, strict=True)),
        return_exceptions=True,
    )
    for t in fabric.transports:
        t.abort()
    want = "AIODIST_HOST_ALGOS differs between ranks: rank 0 has auto, rank 1 has flat"
    assert all(isinstance(e, DistError) and want in str(e) for e in got), got


@pytest.mark.parametrize("layout", ["pairs", "pairs-shm"])
async def test_blocks_either_side_of_a_switch_point_agree_on_the_algorithm(layout: str) -> None:
    """all_gather_object sends blocks of each rank's own size: every rank must still pick the
    same algorithm (by what is equal on all of them), or their messages would not pair."""
    big = select.ALLGATHER_RING_BYTES

    async def fn(g: ProcessGroup) -> list[Any]:
        objs: list[Any] = [None] * g.size
        mine = b"x" * (big * 2 if g.rank % 2 else 16)  # small on some ranks, past the switch on others
        await asyncio.wait_for(dist.all_gather_object(objs, mine, group=g), 20)
        return objs

    res = await run(4, layout, fn)
    want = [b"x" * (big * 2 if r % 2 else 16) for r in range(4)]
    assert all(r == want for r in res)


@pytest.mark.parametrize("layout", ["one-host-direct", "pairs", "pairs-shm", "one-per-host"])
async def test_every_all_gather_form_refuses_a_wrong_block_list_in_its_work(layout: str, algo: str) -> None:
    """The planner only chooses; each form checks its blocks first, inside the operation: a
    list one block short fails the Work with the size error (never an IndexError, never a raise
    at the call), on every form the layout and the size switch pick."""
    from aiodist.backends.base import Op
    from aiodist.backends.native import algorithm
    from aiodist.collectives.steps import run as run_plan

    async def fn(g: ProcessGroup) -> str:
        inp = np.full(8, g.rank, np.float32)
        short = [np.zeros(8, np.float32) for _ in range(g.size - 1)]
        op = Op("all_gather", outputs=tuple(short), inputs=(inp,))
        work = g.run_collective("all_gather", lambda ctx: run_plan(algorithm(ctx, op)), count=8)
        with pytest.raises(dist.DistValueError) as info:
            await work
        return str(info.value)

    for msg in await run(4, layout, fn):
        assert "all_gather output list length" in msg, msg
