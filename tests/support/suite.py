"""The every-operation suite, one copy for every path an operation can take.

``tests/integration/test_every_operation.py`` runs it over transport (memory, TCP, shared memory) x face (async,
sync) x tensor kind (numpy, torch CPU) x staging (none, host-staged); ``test_engine.py`` and
``test_cuda.py`` run it over torch's engines ("torch-gloo", "nccl") and CUDA tensors. Every
operation (every root where there is one), point-to-point (a ring, any source, a batch), dozens
of operations in flight, sizes that take the ring and chunked paths; over processes also
subgroups, a non-member's and a wrong root's errors, objects and Work semantics. Expected values
derive from rank and size.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

import aiodist as dist


def maker(kind: str) -> Any:
    """numpy arrays ("numpy"), torch CPU tensors ("torch") or torch tensors on a device ("cuda")."""
    if kind == "numpy":
        return lambda a: np.ascontiguousarray(a).copy()
    import torch

    if kind == "torch":
        return lambda a: torch.from_numpy(np.ascontiguousarray(a).copy())
    return lambda a: torch.from_numpy(np.ascontiguousarray(a).copy()).to(kind)


def shm_bytes() -> tuple[int, int]:
    """Payload bytes this rank sent and received through shared memory (its job's transport)."""
    from aiodist.face import world as _world

    return tuple(getattr(_world.world().transport, "shm_bytes", (0, 0)))  # type: ignore[return-value]


def host(t: Any) -> np.ndarray:
    return t.cpu().numpy() if hasattr(t, "cpu") else np.asarray(t)


async def every_operation(
    rank: int, size: int, mk: Any, any_source: bool, group: Any = None
) -> dict[str, Any]:
    """Every operation of the async face on ``group`` (None: the default group), whose ranks are
    the global ranks 0..size-1; ``any_source``: also receive from any source."""
    g = group
    out: dict[str, Any] = {}
    n, r = size, rank
    t = mk(np.full(1001, r + 1, np.float32))
    await dist.all_reduce(t, group=g)
    out["all_reduce"] = bool((host(t) == n * (n + 1) / 2).all())
    big = mk(np.arange(700_001, dtype=np.int64) * (r + 1))  # ring, chunked
    await dist.all_reduce(big, dist.ReduceOp.MAX, group=g)
    out["all_reduce_big"] = bool((host(big) == np.arange(700_001) * n).all())
    avg = mk(np.full(7, 2 * r + 1, np.int32))
    await dist.all_reduce(avg, dist.ReduceOp.AVG, group=g)  # integers: truncated toward zero
    out["all_reduce_avg_int"] = host(avg).tolist()
    for root in range(n):
        b = mk(np.arange(300_001, dtype=np.float64) if r == root else np.zeros(300_001))
        await dist.broadcast(b, root, group=g)
        out[f"broadcast{root}"] = bool((host(b) == np.arange(300_001)).all())
        c = mk(np.full(9, r, np.int32))
        await dist.reduce(c, root, dist.ReduceOp.SUM, group=g)
        out[f"reduce{root}"] = bool((host(c) == (sum(range(n)) if r == root else r)).all())
        gl = [mk(np.zeros(3, np.int16)) for _ in range(n)] if r == root else None
        await dist.gather(mk(np.full(3, r, np.int16)), gl, root, group=g)
        if gl is not None:
            out[f"gather{root}"] = [int(host(x)[0]) for x in gl]
        s = mk(np.zeros(2, np.int64))
        await dist.scatter(
            s, [mk(np.full(2, 10 * i, np.int64)) for i in range(n)] if r == root else None, root, group=g
        )
        out[f"scatter{root}"] = int(host(s)[0])
    lst = [mk(np.zeros(4, np.float32)) for _ in range(n)]
    await dist.all_gather(lst, mk(np.full(4, r, np.float32)), group=g)
    out["all_gather"] = [float(host(x)[0]) for x in lst]
    flat = mk(np.zeros(4 * n, np.float32))
    await dist.all_gather_into_tensor(flat, mk(np.full(4, r, np.float32)), group=g)
    out["all_gather_into_tensor"] = host(flat).tolist()
    rs = mk(np.zeros(5, np.int64))
    await dist.reduce_scatter(rs, [mk(np.full(5, 100 * i + r, np.int64)) for i in range(n)], group=g)
    out["reduce_scatter"] = int(host(rs)[0])
    rst = mk(np.zeros(2, np.float64))
    await dist.reduce_scatter_tensor(rst, mk(np.arange(2 * n, dtype=np.float64)), dist.ReduceOp.AVG, group=g)
    out["reduce_scatter_tensor"] = host(rst).tolist()
    a2a = [mk(np.zeros(s + 1, np.int32)) for s in range(n)]
    await dist.all_to_all(a2a, [mk(np.full(r + 1, 10 * r + d, np.int32)) for d in range(n)], group=g)
    out["all_to_all"] = [host(x).tolist() for x in a2a]
    single = mk(np.zeros(sum(s + 1 for s in range(n)), np.int32))
    await dist.all_to_all_single(
        single,
        mk(np.concatenate([np.full(r + 1, 10 * r + d, np.int32) for d in range(n)])),
        [s + 1 for s in range(n)],
        [r + 1] * n,
        group=g,
    )
    out["all_to_all_single"] = host(single).tolist()
    if n > 1:  # point-to-point: a ring, a receive from any source, a batch
        got = mk(np.zeros(8, np.int32))
        sent = dist.isend(mk(np.full(8, r, np.int32)), (r + 1) % n, group=g, tag=3)
        src = await dist.irecv(got, (r - 1) % n, group=g, tag=3)
        await sent
        out["p2p"] = (int(host(got)[0]), src)
        if any_source:  # (NCCL cannot receive from any source)
            anywhere = mk(np.zeros(4, np.float32))
            sent = dist.isend(mk(np.full(4, r, np.float32)), (r + 1) % n, group=g, tag=4)
            src = await dist.irecv(anywhere, None, group=g, tag=4)
            await sent
            out["irecv_any"] = (float(host(anywhere)[0]), src)
        if r == 0 and any_source:
            anys = [mk(np.zeros(2, np.int64)) for _ in range(n - 1)]
            sources = [await dist.recv(x, group=g, tag=5) for x in anys]
            out["recv_any"] = sorted(zip(sources, [int(host(x)[0]) for x in anys], strict=True))
        elif any_source:
            await dist.send(mk(np.full(2, 100 + r, np.int64)), 0, group=g, tag=5)
        bat_in = mk(np.zeros(3, np.float32))
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, mk(np.full(3, float(r), np.float32)), (r + 1) % n, group=g),
                dist.P2POp(dist.irecv, bat_in, (r - 1) % n, group=g),
            ]
        )
        await asyncio.gather(*works)
        out["batch"] = float(host(bat_in)[0])
    # dozens in flight at once, of every size, mixed with point-to-point
    ops = [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT]
    bufs = [mk(np.full(sz, r + 1, np.int64)) for sz in [1, 10, 1000, 50_000, 300_000] * 8]
    flight = [dist.all_reduce(b, ops[i % 4], group=g) for i, b in enumerate(bufs)]
    if n > 1:
        ring = mk(np.zeros(8, np.int32))
        flight.append(dist.isend(mk(np.full(8, r, np.int32)), (r + 1) % n, group=g, tag=6))
        flight.append(dist.irecv(ring, (r - 1) % n, group=g, tag=6))
    await asyncio.gather(*flight)
    fold = [n * (n + 1) // 2, n, 1, int(np.prod(np.arange(1, n + 1)))]
    out["many"] = all(bool((host(b) == fold[i % 4]).all()) for i, b in enumerate(bufs))
    if n > 1:
        out["p2p_in_flight"] = int(host(ring)[0])
    return out


async def async_suite(
    rank: int,
    size: int,
    backend: str,
    kinds: tuple[str, ...],
    stage: bool = False,
    then: Callable[[], Awaitable[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Every operation of the async face for each tensor kind, then subgroups and Works;
    ``then`` runs last, before the group is destroyed, and adds to the results."""
    import os

    os.environ.setdefault("LOCAL_RANK", str(rank))  # as aiodist-run sets it (nccl: the device)
    await dist.init_process_group(backend, "env://", timeout=60)
    from aiodist.face import world as _world

    stager = None
    if stage:
        from aiodist.backends.staged import HostStager

        stager = HostStager()
        _world.set_stager(stager)
    res: dict[str, Any] = {"backend": dist.get_backend()}
    for kind in kinds:
        for k, v in (await every_operation(rank, size, maker(kind), backend != "nccl")).items():
            res[f"{kind}:{k}"] = v
    mk = maker(kinds[-1])
    n, r = size, rank
    evens = await dist.new_group([i for i in range(n) if i % 2 == 0])
    odds = await dist.new_group([i for i in range(n) if i % 2 == 1])
    mine, other = (evens, odds) if r % 2 == 0 else (odds, evens)
    x, y, w = mk(np.full(6, r, np.int64)), mk(np.full(6, r, np.int64)), mk(np.full(6, r, np.int64))
    top = max(i for i in range(n) if i % 2 == r % 2)
    await asyncio.gather(
        dist.all_reduce(x, group=mine), dist.broadcast(y, top, group=mine), dist.all_reduce(w)
    )
    res["sub"] = (int(host(x)[0]), int(host(y)[0]), int(host(w)[0]))
    try:
        dist.all_reduce(mk(np.zeros(1)), group=other)
        res["non_member"] = "no error"
    except dist.DistValueError as exc:
        res["non_member"] = str(exc)
    try:
        dist.broadcast(mk(np.zeros(1)), 1 - r % 2, group=mine)  # a root outside the group
        res["bad_src"] = "no error"
    except dist.DistValueError as exc:
        res["bad_src"] = str(exc)
    # objects travel on aiodist's own transport, beside any engine
    objs: list[Any] = [None] * n
    await dist.all_gather_object(objs, {"rank": r})
    res["objects"] = objs
    # Work: awaitable twice, with the operation's result. (It may have completed in the call: a
    # small collective whose peers' data is here already runs to its end at once.)
    t = mk(np.ones(3, np.float32))
    work = dist.all_reduce(t)
    res["work_results"] = (await work, await work, work.is_completed(), work.is_success(), work.exception())
    await dist.barrier()
    res["shm_bytes"] = shm_bytes()
    if stager is not None:
        res["stager"] = (stager.copies_in, stager.copies_out, stager.pool.hits, stager.pool.in_use_bytes)
    if then is not None:
        res.update(await then())
    await dist.destroy_process_group()
    if stager is not None:
        res["pool_after_destroy"] = (stager.pool.closed, stager.pool.cached_bytes)
    return res


def check_every_operation(o: dict[str, Any], r: int, n: int, what: Any) -> None:
    """The results of ``every_operation`` on rank ``r`` of ``n`` (``what`` names the case)."""
    assert o["all_reduce"] and o["all_reduce_big"] and o["many"], (what, r)
    assert o["all_reduce_avg_int"] == [int(sum(2 * i + 1 for i in range(n)) / n)] * 7
    for root in range(n):
        assert o[f"broadcast{root}"] and o[f"reduce{root}"], (what, root)
        assert o[f"scatter{root}"] == 10 * r
    assert o[f"gather{r}"] == list(range(n))
    assert o["all_gather"] == [float(i) for i in range(n)]
    assert o["all_gather_into_tensor"] == [float(i) for i in range(n) for _ in range(4)]
    assert o["reduce_scatter"] == n * 100 * r + sum(range(n))
    assert o["reduce_scatter_tensor"] == [float(2 * r), float(2 * r + 1)]
    assert o["all_to_all"] == [[10 * s + r] * (s + 1) for s in range(n)]
    assert o["all_to_all_single"] == [10 * s + r for s in range(n) for _ in range(s + 1)]
    if n > 1:
        assert o["p2p"] == ((r - 1) % n, (r - 1) % n)
        assert o["p2p_in_flight"] == (r - 1) % n
        if "irecv_any" in o:
            assert o["irecv_any"] == (float((r - 1) % n), (r - 1) % n)
        if r == 0 and "recv_any" in o:
            assert o["recv_any"] == [(s, 100 + s) for s in range(1, n)]
        assert o["batch"] == float((r - 1) % n)


def check_async_suite(res: list[dict[str, Any]], n: int, kinds: tuple[str, ...]) -> None:
    for r, out in enumerate(res):
        for kind in kinds:
            o = {k.split(":", 1)[1]: v for k, v in out.items() if k.startswith(f"{kind}:")}
            check_every_operation(o, r, n, kind)
        same = [i for i in range(n) if i % 2 == r % 2]
        assert out["sub"] == (sum(same), max(same), sum(range(n)))
        assert "not a member" in out["non_member"]
        assert "is not a member" in out["bad_src"]
        assert out["objects"] == [{"rank": i} for i in range(n)]
        assert out["work_results"] == (None, None, True, True, None)


def sync_suite(
    rank: int,
    size: int,
    backend: str,
    device: str = "cpu",
    stage: bool = False,
    kind: str = "torch",
    then: Callable[[], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """torch.distributed's blocking calls and ``async_op=True`` through the sync face, on torch
    tensors (``kind`` "torch", on ``device``) or numpy arrays (``kind`` "numpy"); ``then`` runs
    last, before the group is destroyed, and adds to the results."""
    import os

    import aiodist.sync as sd

    os.environ.setdefault("LOCAL_RANK", str(rank))
    if device != "cpu":
        import torch

        torch.cuda.set_device(rank % torch.cuda.device_count())  # LOCAL_RANK -> set_device
        device = f"cuda:{torch.cuda.current_device()}"
    sd.init_process_group(backend, rank=rank, world_size=size)
    stager = None
    if stage:
        from aiodist.backends.staged import HostStager
        from aiodist.face import world as _world

        stager = HostStager()
        _world.set_stager(stager)
    mk = maker(kind if device == "cpu" else device)

    out: dict[str, Any] = {"backend": str(sd.get_backend())}
    n, r = size, rank
    t = mk(np.full((3, 5), r + 1, np.float32))
    assert sd.all_reduce(t) is None
    out["all_reduce"] = float(host(t).sum())
    t2 = mk(np.arange(6, dtype=np.float32) * (r + 1))
    work = sd.all_reduce(t2, op=sd.ReduceOp.AVG, async_op=True)
    assert work is not None and work.wait()
    out["avg"] = host(t2).tolist()
    if kind == "torch":
        import torch

        bf = torch.full((4,), 1.5, dtype=torch.bfloat16, device=device)
        sd.all_reduce(bf, sd.ReduceOp.SUM)
        out["bf16"] = bf.float().tolist()
    b = mk(np.arange(4, dtype=np.int64) if r == 1 else np.zeros(4, np.int64))
    sd.broadcast(b, group_src=1)
    out["broadcast"] = host(b).tolist()
    c = mk(np.array([r + 1], np.int64))
    sd.reduce(c, dst=n - 1, op=sd.ReduceOp.PRODUCT)
    out["reduce"] = int(host(c)[0])
    gl = [mk(np.zeros(2, np.float32)) for _ in range(n)] if r == 0 else None
    sd.gather(mk(np.full(2, r, np.float32)), gl)  # dst defaults to 0
    out["gather"] = [float(host(x)[0]) for x in gl] if gl else None
    s = mk(np.zeros(1, np.int32))
    sd.scatter(s, [mk(np.array([7 * i], np.int32)) for i in range(n)] if r == 0 else None, src=0)
    out["scatter"] = int(host(s)[0])
    lst = [mk(np.zeros(2, np.int8)) for _ in range(n)]
    sd.all_gather(lst, mk(np.full(2, r, np.int8)))
    out["all_gather"] = [int(host(x)[0]) for x in lst]
    flat = mk(np.zeros(2 * n, np.float32))
    sd.all_gather_into_tensor(flat, mk(np.full(2, r, np.float32)))
    out["all_gather_into_tensor"] = host(flat).tolist()
    rs = mk(np.zeros(2, np.int64))
    sd.reduce_scatter_tensor(rs, mk(np.arange(2 * n, dtype=np.int64)))
    out["reduce_scatter_tensor"] = host(rs).tolist()
    rsl = mk(np.zeros(1, np.float32))
    sd.reduce_scatter(rsl, [mk(np.array([float(i)], np.float32)) for i in range(n)], op=sd.ReduceOp.MAX)
    out["reduce_scatter"] = float(host(rsl)[0])
    a2a = [mk(np.zeros(1, np.int64)) for _ in range(n)]
    sd.all_to_all(a2a, [mk(np.array([10 * r + d], np.int64)) for d in range(n)])
    out["all_to_all"] = [int(host(x)[0]) for x in a2a]
    single = mk(np.zeros((n, 2), np.float32))
    sd.all_to_all_single(single, mk(np.full((n, 2), r, np.float32)))
    out["all_to_all_single"] = host(single)[:, 0].tolist()
    got = mk(np.zeros(3, np.float32))
    if r == 0:
        sd.send(mk(np.full(3, 9.0, np.float32)), dst=1)
    elif r == 1:
        out["recv_from"] = sd.recv(got, src=0)
    out["got"] = host(got).tolist()
    reqs = sd.batch_isend_irecv(
        [
            sd.P2POp(sd.isend, mk(np.full(2, r, np.float32)), (r + 1) % n),
            sd.P2POp(sd.irecv, got[:2], (r - 1) % n),
        ]
    )
    for req in reqs:
        req.wait()
    out["batch"] = host(got)[:2].tolist()
    objs: list[Any] = [None, None]
    if r == 0:
        objs = [{"a": (1, 2)}, [b"x", None]]
    sd.broadcast_object_list(objs, src=0)
    out["objects"] = objs
    gathered: list[Any] = [None] * n
    sd.all_gather_object(gathered, {"rank": r})
    out["all_gather_object"] = gathered
    sub = sd.new_group([0, n - 1])
    x = mk(np.array([r], np.float32))
    if r in (0, n - 1):
        sd.all_reduce(x, group=sub)
        sd.broadcast(x, src=n - 1, group=sub)
    out["sub"] = float(host(x)[0])
    sd.barrier()
    out["shm_bytes"] = shm_bytes()
    if stager is not None:
        out["stager"] = (stager.copies_in, stager.copies_out, stager.pool.hits, stager.pool.in_use_bytes)
    if then is not None:
        out.update(then())
    sd.destroy_process_group()
    if stager is not None:
        out["pool_after_destroy"] = (stager.pool.closed, stager.pool.cached_bytes)
    return out


def check_sync_suite(res: list[dict[str, Any]], n: int, kind: str = "torch") -> None:
    for r, out in enumerate(res):
        assert out["all_reduce"] == 15 * n * (n + 1) / 2
        assert out["avg"] == [i * (n + 1) / 2 for i in range(6)]
        if kind == "torch":
            assert out["bf16"] == [1.5 * n] * 4
        assert out["broadcast"] == [0, 1, 2, 3]
        assert out["reduce"] == (np.prod(np.arange(1, n + 1)) if r == n - 1 else r + 1)
        assert out["gather"] == ([float(i) for i in range(n)] if r == 0 else None)
        assert out["scatter"] == 7 * r
        assert out["all_gather"] == list(range(n))
        assert out["all_gather_into_tensor"] == [float(i) for i in range(n) for _ in range(2)]
        assert out["reduce_scatter_tensor"] == [n * 2 * r, n * (2 * r + 1)]
        assert out["reduce_scatter"] == float(r)
        assert out["all_to_all"] == [10 * s + r for s in range(n)]
        assert out["all_to_all_single"] == [float(s) for s in range(n)]
        if r == 1:
            assert out["recv_from"] == 0
        assert out["batch"] == [float((r - 1) % n)] * 2
        assert out["objects"] == [{"a": (1, 2)}, [b"x", None]]
        assert out["all_gather_object"] == [{"rank": i} for i in range(n)]
        assert out["sub"] == (float(n - 1) if r in (0, n - 1) else float(r))


def _object_of(r: int) -> dict[str, Any]:
    """Rank ``r``'s object: plain data of several kinds, and a string long enough to take
    more than one TCP segment."""
    return {"rank": r, "pair": (r, str(r)), "raw": bytes([r]) * 3, "none": None, "long": "x" * (5000 + r)}


async def every_object_operation(rank: int, size: int) -> dict[str, Any]:
    """Every object collective of the async face, every root; check with ``check_object_operations``."""
    n, r = size, rank
    out: dict[str, Any] = {}
    for root in range(n):
        objs: list[Any] = [_object_of(root), [root] * 3] if r == root else [None, None]
        await dist.broadcast_object_list(objs, src=root)
        out[f"broadcast_object_list{root}"] = objs
        gathered: list[Any] | None = [None] * n if r == root else None
        await dist.gather_object(_object_of(r), gathered, dst=root)
        if gathered is not None:
            out["gather_object"] = gathered
        scattered: list[Any] = [None]
        await dist.scatter_object_list(
            scattered, [_object_of(i) for i in range(n)] if r == root else None, src=root
        )
        out[f"scatter_object_list{root}"] = scattered[0]
    every: list[Any] = [None] * n
    await dist.all_gather_object(every, _object_of(r))
    out["all_gather_object"] = every
    if n > 1:  # a ring of send_object_list / recv_object_list
        got: list[Any] = [None, None]
        sent = dist.send_object_list([_object_of(r), "to"], (r + 1) % n)
        out["recv_object_list"] = (await dist.recv_object_list(got, (r - 1) % n), got)
        await sent
    return out


def sync_object_operations(rank: int, size: int) -> dict[str, Any]:
    """``every_object_operation`` through the sync face (blocking, as torch's are)."""
    import aiodist.sync as sd

    n, r = size, rank
    out: dict[str, Any] = {}
    for root in range(n):
        objs: list[Any] = [_object_of(root), [root] * 3] if r == root else [None, None]
        sd.broadcast_object_list(objs, src=root)
        out[f"broadcast_object_list{root}"] = objs
        gathered: list[Any] | None = [None] * n if r == root else None
        sd.gather_object(_object_of(r), gathered, dst=root)
        if gathered is not None:
            out["gather_object"] = gathered
        scattered: list[Any] = [None]
        sd.scatter_object_list(scattered, [_object_of(i) for i in range(n)] if r == root else None, src=root)
        out[f"scatter_object_list{root}"] = scattered[0]
    every: list[Any] = [None] * n
    sd.all_gather_object(every, _object_of(r))
    out["all_gather_object"] = every
    if n > 1:  # a ring: even ranks send first, odd ones receive first (blocking calls)
        got: list[Any] = [None, None]
        for step in ("send", "recv") if r % 2 == 0 else ("recv", "send"):
            if step == "send":
                sd.send_object_list([_object_of(r), "to"], (r + 1) % n)
            else:
                out["recv_object_list"] = (sd.recv_object_list(got, (r - 1) % n), got)
    return out


def check_object_operations(o: dict[str, Any], r: int, n: int) -> None:
    """The results of ``every_object_operation`` (or its sync twin) on rank ``r`` of ``n``."""
    for root in range(n):
        assert o[f"broadcast_object_list{root}"] == [_object_of(root), [root] * 3], (r, root)
        assert o[f"scatter_object_list{root}"] == _object_of(r), (r, root)
    assert o["gather_object"] == [_object_of(i) for i in range(n)], r
    assert o["all_gather_object"] == [_object_of(i) for i in range(n)], r
    if n > 1:
        assert o["recv_object_list"] == ((r - 1) % n, [_object_of((r - 1) % n), "to"]), r


async def memory_suite(n: int, kind: str, stage: bool) -> list[dict[str, Any]]:
    """``every_operation`` with ``n`` ranks as tasks over the in-memory transport; ``stage``:
    each rank stages every tensor through ``HostStager`` (whose twins are poisoned, so right
    results mean every input was copied in before use and every output copied back)."""
    from aiodist.backends.staged import HostStager
    from support.worlds import staged_world

    stagers = [HostStager() for _ in range(n)] if stage else []
    fabric, groups = staged_world(stagers or [None] * n)
    try:
        res = await asyncio.wait_for(
            asyncio.gather(*(every_operation(g.rank, n, maker(kind), True, g) for g in groups)), 60
        )
    finally:
        for tr in fabric.transports:
            tr.abort()
    out = list(res)
    for o, stager in zip(out, stagers, strict=False):
        o["stager"] = (stager.copies_in, stager.copies_out, stager.pool.hits, stager.pool.in_use_bytes)
    return out
