"""Shared memory between processes of one host: when it is used, when it is not, and its
harder paths (messages before their receives, a full ring, two-copy pieces), with real processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any

import numpy as np
import pytest

import aiodist as dist
from aiodist.face.world import world
from aiodist.testing import spawn

pytestmark = pytest.mark.timeout(120)


def _transport() -> Any:
    return world().transport


async def _check_ops(rank: int, size: int) -> dict[str, Any]:
    """A few operations of every message size; results derived from rank and size."""
    ok = {}
    for n in (1, 1000, 100_000, 3_000_001):
        a = np.full(n, rank + 1, np.int64)
        await dist.all_reduce(a)
        b = np.arange(n, dtype=np.int64) if rank == 0 else np.zeros(n, np.int64)
        await dist.broadcast(b, 0)
        ok[n] = bool((a == size * (size + 1) // 2).all() and (b == np.arange(n)).all())
    return ok


async def _where(rank: int, size: int, host_ids: list[str] | None, patch_dir: str | None) -> dict[str, Any]:
    if host_ids is not None:
        os.environ["AIODIST_HOST_ID"] = host_ids[rank]
    if patch_dir is not None and rank == 1:
        # This rank's segments live where its peers do not look (a /dev/shm they do not share),
        # and it looks for theirs there: every proof fails.
        from aiodist.transport import shm_segment

        shm_segment.SEGMENT_DIR = patch_dir
    await dist.init_process_group("tcp", "env://", timeout=60)
    t = _transport()
    out = {
        "local": t.local_peers(),
        "hosts": {p: t.host_keys[p] for p in range(size) if p != rank},
        "me": t.host_id,
        "shares": [p in t.local_peers() for p in range(size)],
        "ok": await _check_ops(rank, size),
    }
    out["shm_bytes"] = t.shm_bytes
    await dist.destroy_process_group()
    return out


def test_ranks_of_one_host_share_memory() -> None:
    res = spawn(_where, 3, args=(None, None), timeout=100)
    for r, out in enumerate(res):
        others = [p for p in range(3) if p != r]
        assert out["local"] == others
        assert out["shares"] == [p != r for p in range(3)]
        assert set(out["hosts"].values()) == {out["me"]}
        assert all(out["ok"].values())
        assert min(out["shm_bytes"]) > 3_000_000 * 8


def test_off_switch_keeps_tcp() -> None:
    res = spawn(_where, 2, args=(None, None), env={"AIODIST_SHM": "0"}, timeout=100)
    for out in res:
        assert out["local"] == [] and out["shm_bytes"] == (0, 0)
        assert all(out["ok"].values())


def test_forced_hosts_split_the_job() -> None:
    """AIODIST_HOST_ID places ranks of one machine on "different hosts": shared memory only
    within each, and every rank knows every peer's host (for hierarchical algorithms)."""
    ids = ["hostA", "hostA", "hostB", "hostB"]
    res = spawn(_where, 4, args=(ids, None), timeout=110)
    for r, out in enumerate(res):
        assert out["me"] == ids[r]
        assert out["local"] == [r ^ 1]
        assert out["hosts"] == {p: ids[p] for p in range(4) if p != r}
        assert all(out["ok"].values())


def test_a_failed_proof_falls_back_to_tcp(tmp_path: Any) -> None:
    res = spawn(_where, 3, args=(None, str(tmp_path)), timeout=100)
    for r, out in enumerate(res):
        assert all(out["ok"].values())
        assert 1 not in out["local"], out
        assert out["local"] == ([] if r == 1 else [2 - r]), out  # ranks 0 and 2 still share
    assert list(tmp_path.iterdir()) == []  # rank 1's refused segments were removed


async def _early_and_many(rank: int, size: int) -> dict[str, Any]:
    """Rank 0 sends far more than a ring holds (eager messages, small and as large as a record
    may be, and large ones by descriptor or in pieces) before rank 1 posts a single receive;
    rank 1 then takes them in another order. (A large eager message first waits in the ring for
    its receive, then is held: records behind it must not wait for ever.)"""
    await dist.init_process_group("tcp", "env://", timeout=60)
    small = [np.full(60_000 // 8, i, np.int64) for i in range(150)]  # 9 MB of eager messages
    big = [np.arange(1 << 20, dtype=np.int64) * (i + 1) for i in range(3)]  # 8 MiB each
    mid = [np.full((1 << 20) // 8, i, np.int64) for i in range(4)]  # 1 MiB each: one eager record
    out: dict[str, Any] = {}
    if rank == 0:
        sends = [dist.isend(b, 1, tag=100 + i) for i, b in enumerate(big)]
        sends += [dist.isend(m, 1, tag=200 + i) for i, m in enumerate(mid)]
        sends += [dist.isend(s, 1, tag=7) for s in small]  # one tag: must arrive in order
        await asyncio.gather(*sends)
    else:
        await asyncio.sleep(0.5)  # everything above is sent (or waiting for room) by now
        got_big = [np.zeros(1 << 20, np.int64) for _ in range(3)]
        for i in (2, 0, 1):
            await dist.recv(got_big[i], 0, tag=100 + i)
        got_mid = [np.zeros((1 << 20) // 8, np.int64) for _ in range(4)]
        for i in (3, 1, 2, 0):
            await dist.recv(got_mid[i], 0, tag=200 + i)
        out["mid"] = [bool((g == i).all()) for i, g in enumerate(got_mid)]
        got = []
        for _ in range(150):
            x = np.zeros(60_000 // 8, np.int64)
            await dist.recv(x, 0, tag=7)
            got.append(int(x[0]) if (x == x[0]).all() else -1)
        out["small"] = got
        out["big"] = [bool((g == np.arange(1 << 20) * (i + 1)).all()) for i, g in enumerate(got_big)]
    out["shm_bytes"] = _transport().shm_bytes
    await dist.barrier()
    await dist.destroy_process_group()
    return out


@pytest.mark.parametrize("mode", ["1", "copy"])
def test_messages_before_their_receives_and_a_full_ring(mode: str) -> None:
    res = spawn(_early_and_many, 2, env={"AIODIST_SHM": mode}, timeout=100)
    assert res[1]["small"] == list(range(150))
    assert res[1]["big"] == [True] * 3
    assert res[1]["mid"] == [True] * 4
    assert res[1]["shm_bytes"][1] >= 150 * 60_000 + 3 * (8 << 20) + 4 * (1 << 20)


async def _mismatch(rank: int, size: int) -> str:
    await dist.init_process_group("tcp", "env://", timeout=30)
    assert _transport().local_peers() == [1 - rank]
    try:
        await dist.all_reduce(np.zeros(100_000 if rank == 0 else 200_000, np.float32))
        return "no error"
    except dist.CollectiveMismatchError as exc:
        return str(exc)
    finally:
        await dist.destroy_process_group()


async def _reductions_together(rank: int, size: int, detail: bool) -> dict[str, Any]:
    """Large reductions started together take turns (in the order of their calls); copies and
    small operations between them do not wait; every result is right."""
    if detail:
        os.environ["AIODIST_DEBUG"] = "DETAIL"
    await dist.init_process_group("tcp", "env://", timeout=60)
    assert _transport().local_peers()
    n = 1 << 19  # 2 MiB of float32
    a1 = np.full(n, rank + 1.0, np.float32)
    rs_in = np.arange(2 * n, dtype=np.float32) * (rank + 1)
    rs_out = np.zeros(n, np.float32)
    small = np.full(1, rank + 1, np.int64)
    a2 = np.full(n, 10.0 * (rank + 1), np.float32)
    red = np.full(n, rank + 3.0, np.float32)
    bc = np.full(n, 7.0 if rank == 0 else 0.0, np.float32)
    order: list[str] = []

    async def track(name: str, work: Any) -> None:
        await work
        order.append(name)

    # The second of two large all_reduces posts nothing while the first waits for rank 1, which
    # starts 0.5 s late.
    from aiodist.transport.base import COLL

    g = world().default_group
    big = [np.full(4 << 20, rank + 1.0, np.float32) for _ in range(2)]
    await dist.barrier()
    keys = [(g.gid, COLL, g._seq + i) for i in range(2)]
    if rank == 1:
        await asyncio.sleep(0.5)
    first, second = dist.all_reduce(big[0]), dist.all_reduce(big[1])
    if rank == 0:
        await asyncio.sleep(0.1)
        posted = [world().transport.mailbox.waiting_on(k) for k in keys]
    await first
    await second
    ok_big = all(bool((b == 3.0).all()) for b in big)

    await asyncio.gather(
        track("all_reduce 1", dist.all_reduce(a1)),
        track("reduce_scatter", dist.reduce_scatter_tensor(rs_out, rs_in)),
        track("small", dist.all_reduce(small)),
        track("all_reduce 2", dist.all_reduce(a2)),
        track("reduce", dist.reduce(red, 1)),
        track("broadcast", dist.broadcast(bc, 0)),
    )
    want_rs = np.arange(rank * n, (rank + 1) * n, dtype=np.float32) * 3
    ok = {
        "16 MiB": ok_big,
        "all_reduce 1": bool((a1 == 3.0).all()),
        "reduce_scatter": bool((rs_out == want_rs).all()),
        "small": int(small[0]) == 3,
        "all_reduce 2": bool((a2 == 30.0).all()),
        "reduce": bool((red == 7.0).all()) if rank == 1 else True,
        "broadcast": bool((bc == 7.0).all()),
    }
    await dist.destroy_process_group()
    return {
        "ok": ok,
        "order": [o for o in order if o not in ("small", "broadcast")],
        "posted": posted if rank == 0 else None,
    }


@pytest.mark.parametrize("detail", [False, True], ids=["plain", "DETAIL"])
def test_large_reductions_started_together_take_turns(detail: bool) -> None:
    res = spawn(_reductions_together, 2, args=(detail,), timeout=100)
    out0 = res[0]
    for out in res:
        assert all(out["ok"].values()), out["ok"]
        assert out["order"] == ["all_reduce 1", "reduce_scatter", "all_reduce 2", "reduce"], out["order"]
    first, second = out0["posted"]
    assert second == [], out0["posted"]
    # (With DETAIL the first checks fingerprints with rank 1 before it posts anything.)
    assert first == ([] if detail else [1]), out0["posted"]


async def _timeout_waiting_its_turn(rank: int, size: int) -> dict[str, Any]:
    """Rank 1 comes 1 s late to a large all_reduce; rank 0's next one, with a 0.3 s timeout,
    times out waiting for its turn and says so. Then the usual recovery: the group is out of
    step (rank 1 never entered the one that timed out) until every rank calls resync."""
    await dist.init_process_group("tcp", "env://", timeout=60)
    first, second = (np.full(4 << 20, rank + 1.0, np.float32) for _ in range(2))
    await dist.barrier()
    out: dict[str, Any] = {}
    if rank == 1:
        await asyncio.sleep(1.0)
    try:
        a = dist.all_reduce(first)
        b = dist.all_reduce(second, timeout=0.3)
        for name, work in (("second", b), ("first", a)):
            try:
                await work
            except dist.DistError as exc:
                out[name] = f"{type(exc).__name__}: {exc}"
    except dist.DistError as exc:  # rank 1: stopped at its next collective
        out["call"] = type(exc).__name__
    await dist.resync()
    small = np.full(1, rank + 1, np.int64)
    await dist.all_reduce(small)
    out["after"] = int(small[0])
    await dist.destroy_process_group()
    return out


def test_a_reduction_that_times_out_waiting_its_turn_says_so() -> None:
    res = spawn(_timeout_waiting_its_turn, 2, timeout=60)
    msg = res[0]["second"]
    assert msg.startswith("DistTimeoutError: all_reduce #2 on rank 0"), msg
    assert "waiting for its turn: all_reduce #1 had not ended on rank 0" in msg, msg
    assert "waiting for data" not in msg and "rank 1 never entered it" in msg, msg
    assert res[0]["first"].startswith("GroupOutOfStepError"), res[0]
    assert res[1]["call"] == "GroupOutOfStepError", res[1]
    assert [out["after"] for out in res] == [3, 3]


def test_mismatch_is_caught_over_shared_memory() -> None:
    """Sizes and fingerprints travel with every shared-memory message, as on TCP."""
    res = spawn(_mismatch, 2, timeout=60)
    for msg in res:
        assert "rank 0" in msg and "rank 1" in msg, msg


# -- in one process: both ends' insides in view -----------------------------------------------


async def _mesh(n: int, cap: int) -> list[Any]:
    from aiodist.transport.shm_tcp import ShmTcpTransport

    ts = [ShmTcpTransport(r, n, job="shm-test", secret=b"s") for r in range(n)]
    for t in ts:
        t.mailbox.unexpected_cap = cap
    ports = [await t.listen("127.0.0.1") for t in ts]
    await asyncio.gather(
        *(ts[r].connect(p, "127.0.0.1", ports[p], 5.0) for r in range(n) for p in range(r)),
        *(ts[r].expect(p) for r in range(n) for p in range(r + 1, n)),
    )
    await asyncio.gather(*(t.shm_settled() for t in ts))
    assert all(t.local_peers() for t in ts)
    return ts


def _groups(ts: list[Any]) -> list[Any]:
    from aiodist.group import ProcessGroup

    return [ProcessGroup(t, range(len(ts)), 0, timeout=30) for t in ts]


@pytest.mark.timeout(30)
async def test_unexpected_messages_never_exceed_the_cap() -> None:
    cap = 1 << 20
    ts = await _mesh(2, cap)
    mb = ts[0].mailbox
    peak = 0
    real = mb.deliver

    def spy(*args: Any, **kwargs: Any) -> None:
        nonlocal peak
        real(*args, **kwargs)
        peak = max(peak, mb.unexpected_bytes + ts[0]._incoming)

    mb.deliver = spy
    try:
        g0, g1 = _groups(ts)
        small = [np.full(16 * 1024, i, np.float32) for i in range(40)]  # 40 x 64 KiB eager, tag 1
        big = np.arange(4 << 20, dtype=np.float32)  # 16 MiB, tag 2: alone more than the cap
        sends = [g1.send(a, 0, tag=1) for a in small] + [g1.send(big, 0, tag=2)]
        await asyncio.sleep(0.3)
        assert mb.unexpected_bytes + ts[0]._incoming <= cap
        assert ts[0]._shm.capped()  # reading from rank 1 waits, not buffering without bound
        got_big = np.zeros_like(big)
        got_small = [np.zeros_like(a) for a in small]
        recvs = [g0.recv(b, 1, tag=1) for b in got_small]
        recvs.append(g0.recv(got_big, 1, tag=2))
        await asyncio.wait_for(asyncio.gather(*recvs, *sends), 10)
        assert all((a == b).all() for a, b in zip(small, got_small, strict=True))
        assert (got_big == big).all()
        assert peak <= cap and mb.unexpected_bytes == 0 and not ts[0]._shm.capped()
        assert ts[0].shm_bytes[1] >= big.nbytes
    finally:
        for t in ts:
            t.abort()


@pytest.mark.timeout(30)
async def test_timeout_while_waiting_for_room_says_why_and_recovers() -> None:
    ts = await _mesh(2, 256 * 1024)
    try:
        g0, g1 = _groups(ts)
        blocks = [np.full(8 * 1024, i, np.float64) for i in range(8)]  # 8 x 64 KiB on tag 1
        s1 = [g1.send(b, 0, tag=1) for b in blocks]
        s2 = g1.send(np.array([42.0]), 0, tag=2)  # behind them
        small = np.zeros(1)
        with pytest.raises(dist.DistTimeoutError, match=r"paused.*AIODIST_UNEXPECTED_CAP"):
            await g0.recv(small, 1, tag=2, timeout=0.5)
        for i in range(8):
            got = np.zeros(8 * 1024)
            await asyncio.wait_for(g0.recv(got, 1, tag=1), 5)
            assert (got == i).all()
        await asyncio.wait_for(g0.recv(small, 1, tag=2), 5)
        assert small[0] == 42.0
        await asyncio.gather(*s1, s2)
    finally:
        for t in ts:
            t.abort()


def _init_with_bad_switch(rank: int, size: int) -> str:
    import aiodist.sync as sd

    try:
        sd.init_process_group("gloo", rank=rank, world_size=size, timeout=30)
        return "no error"
    except ValueError as exc:  # (a DistValueError: misuse)
        return str(exc)


def test_a_bad_switch_is_refused_before_the_rendezvous() -> None:
    t0 = time.monotonic()
    res = spawn(_init_with_bad_switch, 2, env={"AIODIST_SHM": "maybe"}, timeout=60)
    assert all("AIODIST_SHM must be 1, 0 or copy, got 'maybe'" in r for r in res), res
    assert time.monotonic() - t0 < 30  # not at the rendezvous timeout


@pytest.mark.timeout(30)
async def test_a_lost_wakeup_costs_a_moment_never_a_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader says it polls, so the writer skips the doorbell; the reader stops polling
    having looked just before the record landed (store-load reordering). The writer's second
    look rings then: the message arrives a moment late, not never."""
    monkeypatch.setenv("AIODIST_BUSY_POLL_US", "0")  # nobody polls for real here
    from aiodist.settings import Settings
    from aiodist.transport import shm_segment

    Settings.read().apply()  # (as an init applies it: these transports are made by hand)

    if not shm_segment.SKIP_BELLS:
        pytest.skip("doorbells are never skipped on this machine")
    ts = await _mesh(2, 1 << 20)
    try:
        g0, g1 = _groups(ts)
        flag = ts[0]._shm.links[1].out.words  # rank 0's "I poll" flag, read by rank 1
        flag[shm_segment.W_POLLING] = 1
        got = np.zeros(2)
        recv = g0.recv(got, 1)
        bells = ts[1]._shm.bell
        rung: list[float] = []
        ts[1]._shm.bell = lambda peer: (rung.append(time.monotonic()), bells(peer))
        t0 = time.monotonic()
        await g1.send(np.array([1.0, 2.0]), 0)
        assert not rung  # skipped: rank 0 "polls"
        flag[shm_segment.W_POLLING] = 0  # ... and stops without having seen the record
        await asyncio.wait_for(recv, 5)
        assert got.tolist() == [1.0, 2.0]
        assert rung and rung[0] - t0 < 1.0  # rung on the second look, a moment later
    finally:
        for t in ts:
            t.abort()


@pytest.mark.timeout(30)
async def test_a_link_whose_peer_is_gone_waits_for_nothing() -> None:
    """A record waiting for its receive (and for room under the cap) when the peer dies: the
    link stops counting as stalled, so no later receive schedules retries for it."""
    ts = await _mesh(2, 64 * 1024)
    try:
        _g0, g1 = _groups(ts)
        sent = g1.send(np.ones(64 * 1024, np.float32), 0, tag=3)  # 256 KiB: waits in the ring (over the cap)
        for _ in range(200):
            if ts[0]._shm.stalled:
                break
            await asyncio.sleep(0.005)
        assert ts[0]._shm.stalled, "the record should wait in the ring for its receive"
        ts[1].abort()
        for _ in range(400):
            if not ts[0]._shm.stalled:
                break
            await asyncio.sleep(0.005)
        assert not ts[0]._shm.stalled
        with contextlib.suppress(Exception):
            await sent
    finally:
        for t in ts:
            t.abort()


async def _one_by_one(sender: Any, receiver: Any, n: int) -> None:
    """``n`` small messages from ``sender``'s rank to ``receiver``'s (rank 0), each received
    (whole and right) before the next is sent."""
    for i in range(n):
        got = np.zeros(4)
        recv = receiver.recv(got, 1)
        await sender.send(np.full(4, float(i)), 0)
        await asyncio.wait_for(recv, 5)
        assert got.tolist() == [float(i)] * 4


@pytest.mark.timeout(30)
async def test_a_reader_that_does_not_poll_is_woken_through_its_doorbell(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nobody polls here, so every message rings: a datagram to the reader's doorbell (its name
    gone from the directory once both ends have it), never a frame on the connection; a
    doorbell whose reader has gone gives way to the frame, and nothing is lost either way."""
    monkeypatch.setenv("AIODIST_BUSY_POLL_US", "0")
    from aiodist.settings import Settings
    from aiodist.transport import shm_segment
    from aiodist.wire.shm import ShmBell

    Settings.read().apply()
    ts = await _mesh(2, 1 << 20)
    try:
        g0, g1 = _groups(ts)
        reader, writer = ts[0]._shm, ts[1]._shm
        assert reader.links[1].bell_in is not None and writer.links[0].bell_out is not None
        assert not [n for n in os.listdir(shm_segment.SEGMENT_DIR) if "shm-test" in n and "-bell-" in n]
        frames, rung = [], []
        heard, real_rung = reader.message, reader._rung
        reader.message = lambda peer, msg: (frames.append(msg), heard(peer, msg))
        reader._rung = lambda link: (rung.append(1), real_rung(link))
        reader.loop.remove_reader(reader.links[1].bell_in)  # (the listener registered before the spy)
        reader.loop.add_reader(reader.links[1].bell_in, reader._rung, reader.links[1])
        await _one_by_one(g1, g0, 30)
        assert rung and not any(isinstance(m, ShmBell) for m in frames), (len(rung), frames)

        reader.links[1].drop_bell_in()  # the reader's doorbell goes (as with a failed link) ...
        await _one_by_one(g1, g0, 5)
        assert writer.links[0].bell_out is None  # ... and the frames ring instead
        assert any(isinstance(m, ShmBell) for m in frames)
    finally:
        for t in ts:
            t.abort()
