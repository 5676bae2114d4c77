"""Host-aware collectives over real processes: ranks told they run on different hosts.

Each rank sets ``AIODIST_HOST_ID`` before it joins (two "hosts" of two ranks, or 3 + 1), so the
rendezvous agrees on a host map with several hosts and the hierarchical algorithms run over
loopback TCP; the every-operation suite checks every result, and the ``aiodist`` logger's DEBUG
records show which path each operation took. On one host with ``AIODIST_HOST_ALGOS=direct`` the
one-host direct algorithms run over TCP the same way.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.faults import mark, since
from support.paths import HostAwarePaths
from support.suite import async_suite, check_async_suite, check_sync_suite, sync_suite

from aiodist.testing import spawn

pytestmark = pytest.mark.timeout(180)


async def _suite_on_hosts(
    rank: int, size: int, hosts: list[str], mode: str, env: dict[str, str] | None = None
) -> dict[str, Any]:
    os.environ["AIODIST_HOST_ID"] = hosts[rank]
    os.environ["AIODIST_HOST_ALGOS"] = mode
    os.environ.update(env or {})
    paths = HostAwarePaths().attach()
    import aiodist as dist
    from aiodist.face import world as _world

    keys: list[str] = []
    shm: list[bool] = []
    orig_destroy = dist.destroy_process_group

    async def destroy(*args: Any, **kwargs: Any) -> None:
        transport = _world.world().transport
        keys.extend(transport.host_keys or ())  # the map the rendezvous agreed on
        shm.extend(transport.shm_local or ())  # who reaches all of its host through shared memory
        await orig_destroy(*args, **kwargs)

    dist.destroy_process_group = destroy  # type: ignore[assignment]
    try:
        res = await async_suite(rank, size, "tcp", ("numpy",))
    finally:
        dist.destroy_process_group = orig_destroy  # type: ignore[assignment]
        logging.getLogger("aiodist").removeHandler(paths)
    res["paths"] = sorted(paths.seen)
    res["host_keys"] = keys
    res["shm"] = shm
    return res


@pytest.mark.parametrize("hosts", [["h0", "h0", "h1", "h1"], ["a", "a", "a", "b"]], ids=["2x2", "3+1"])
def test_every_operation_on_two_hosts_runs_hierarchical(hosts: list[str]) -> None:
    n = len(hosts)
    res = spawn(_suite_on_hosts, n, args=(hosts, "auto"), timeout=170)
    check_async_suite(res, n, ("numpy",))
    for r, out in enumerate(res):
        assert out["host_keys"] == hosts
        # Small buffers in phases, large ones (all_reduce of 5.6 MB, broadcasts of 2.4 MB) in
        # chains with the ranks in host order, and in two levels where every host has as many
        # ranks sharing memory (else in a ring in host order).
        uniform = len({hosts.count(h) for h in hosts}) == 1 and all(out["shm"])
        large = "all_reduce two-level" if uniform else "all_reduce host-ordered"
        for path in ("all_reduce hierarchical", large, "broadcast host-ordered"):
            assert path in out["paths"], (path, out["paths"])
        for op in ("reduce", "all_gather", "barrier"):
            assert f"{op} hierarchical" in out["paths"], (op, out["paths"])
        # Inside a host: the direct forms where its ranks share memory (the shared-memory
        # transport), else the flat ones over TCP.
        assert all(hosts.count(hosts[k]) > 1 for k in range(n) if out["shm"][k])
        assert ("broadcast direct" in out["paths"]) == out["shm"][r], (r, out["shm"], out["paths"])


def _sync_suite_on_hosts(rank: int, size: int, hosts: list[str]) -> dict[str, Any]:
    os.environ["AIODIST_HOST_ID"] = hosts[rank]
    paths = HostAwarePaths().attach()
    res = sync_suite(rank, size, "gloo", "cpu", False, "torch")
    res["paths"] = sorted(paths.seen)
    return res


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
def test_sync_face_with_torch_tensors_on_two_hosts() -> None:
    hosts = ["h0", "h1", "h0", "h1"]  # hosts that interleave: leaders 0 and 1
    res = spawn(_sync_suite_on_hosts, 4, args=(hosts,), timeout=170)
    check_sync_suite(res, 4, "torch")
    for out in res:
        assert "all_reduce hierarchical" in out["paths"], out["paths"]


def test_every_operation_on_one_host_with_direct_algorithms() -> None:
    n = 3
    res = spawn(_suite_on_hosts, n, args=(["h"] * n, "direct"), timeout=170)
    check_async_suite(res, n, ("numpy",))
    for out in res:
        for op in ("all_reduce", "broadcast", "all_gather", "reduce_scatter"):
            assert f"{op} direct" in out["paths"], (op, out["paths"])
        assert not any(p.endswith(" hierarchical") for p in out["paths"])


def test_one_host_without_shared_memory_stays_flat() -> None:
    """AIODIST_SHM=0 turns shared memory off where the transport has it; without it the ranks of
    one host talk over TCP, where the flat algorithms stay."""
    res = spawn(_suite_on_hosts, 2, args=(["h", "h"], "auto", {"AIODIST_SHM": "0"}), timeout=170)
    check_async_suite(res, 2, ("numpy",))
    assert all(out["shm"] == [False, False] for out in res)
    assert all(out["paths"] == [] for out in res)


async def _kill_leader_mid_all_reduce(rank: int, size: int, out: str) -> dict[str, Any]:
    """Hosts h0 = {0, 1}, h1 = {2, 3}; rank 2 (h1's leader) dies inside the 6th all_reduce."""
    import aiodist as dist

    os.environ["AIODIST_HOST_ID"] = f"h{rank // 2}"
    marker = Path(out, "killed")
    await dist.init_process_group("tcp", "env://", timeout=60)
    t = np.ones(1 << 20, np.float32)
    result: dict[str, Any] = {}
    for i in range(20):
        t[:] = 1
        if rank == 2 and i == 5:
            dist.all_reduce(t)
            await asyncio.sleep(0)  # its first messages are out; the operation waits for data
            mark(marker)
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            await dist.all_reduce(t)
        except dist.DistNetworkError as exc:
            result.update(iteration=i, took=since(marker), msg=str(exc))
            break
        assert (t == size).all()
    await dist.destroy_process_group()
    return result


def test_a_leader_killed_mid_hierarchical_all_reduce_is_named_at_once(tmp_path: Path) -> None:
    """Its host's other rank waits only on it, the other host's ranks on their own leader: each
    survivor still fails within 2 s naming rank 2, not at the 60 s timeout."""
    res = spawn(_kill_leader_mid_all_reduce, 4, args=(str(tmp_path),), expect_failure=[2], timeout=90)
    for rank in (0, 1, 3):
        r = res[rank]
        assert r.get("iteration") == 5, (rank, r)
        assert "rank 2" in r["msg"], (rank, r["msg"])
        assert r["took"] < 2.0, (rank, r)


async def _init_with_switch(rank: int, size: int, modes: list[str]) -> str:
    import aiodist as dist

    os.environ["AIODIST_HOST_ALGOS"] = modes[rank]
    try:
        await dist.init_process_group("tcp", "env://", timeout=30)
    except dist.DistError as exc:
        return f"{type(exc).__name__}: {exc}"
    await dist.destroy_process_group()
    return "joined"


@pytest.mark.parametrize(
    ("modes", "want"),
    [
        (["auto", "flat"], "AIODIST_HOST_ALGOS differs between ranks: rank 0 has auto, rank 1 has flat"),
        (["auto", "nope"], "rank 1: AIODIST_HOST_ALGOS='nope': use one of auto, flat, direct"),
    ],
)
def test_ranks_must_agree_on_the_switch(modes: list[str], want: str) -> None:
    """The host-aware choices must be equal on every rank: the rendezvous refuses otherwise, on
    every rank, naming the value, well before its timeout."""
    res = spawn(_init_with_switch, 2, args=(modes,), timeout=60)
    assert all(want in msg for msg in res), res
    assert any(msg.startswith("DistValueError") for msg in res), res  # the rank that found it


def test_one_host_automatic_choice_follows_shared_memory() -> None:
    """With the default settings the direct forms run exactly where the ranks agreed they share
    memory (the shared-memory transport), and the flat ones elsewhere."""
    n = 3
    res = spawn(_suite_on_hosts, n, args=(["h"] * n, "auto"), timeout=170)
    check_async_suite(res, n, ("numpy",))
    for out in res:
        assert out["shm"] == res[0]["shm"] and len(out["shm"]) == n
        shared = all(out["shm"])
        assert ("all_gather direct" in out["paths"]) == shared, out
        assert ("broadcast direct" in out["paths"]) == shared, out
        assert not any(p.endswith(" hierarchical") for p in out["paths"])
