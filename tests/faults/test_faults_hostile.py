"""Hostile input against a running job, with real processes (FAULTS.md rows 11-15, 17, 18).

Two jobs run at once on this host, each with its own ``AIODIST_SECRET``. While they work
(all_reduce, store traffic, results checked every step), the test throws garbage at job A's
store port and peer ports, opens 500 slow connections, connects with a wrong secret, and
job B tries to reach into job A. Every intrusion is refused and dropped within the handshake
deadline, warnings are rate-limited and name the remote address, both jobs finish with exact
results, and job A's file descriptors return to their baseline.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.faults import Trap, fd_count, hostile_bytes, record

import aiodist as dist
from aiodist.errors import DistError
from aiodist.face.world import world
from aiodist.store import TCPStore
from aiodist.testing import free_port, spawn
from aiodist.transport.tcp import TcpTransport
from aiodist.wire.frames import encode_frame

pytestmark = pytest.mark.timeout(120)

DEADLINE = 1.0  # AIODIST_HANDSHAKE_TIMEOUT of the jobs under attack
FLOOD = 500


GARBAGE: dict[str, bytes] = {
    **hostile_bytes(seed=5),
    "half-frame-200": struct.pack("!IQ", 200, 0) + b"\x00" * 100,
}


async def _job(rank: int, size: int, out: str, label: str) -> dict[str, Any]:
    logging.basicConfig(filename=str(Path(out, f"log_{label}_{rank}")), level=logging.WARNING)
    await dist.init_process_group("tcp", "env://", timeout=30)
    w = world()
    result: dict[str, Any] = {"peer_bind": w.transport._server.sockets[0].getsockname()[0]}  # type: ignore[union-attr]
    if rank == 0:
        server = w.store.server  # type: ignore[attr-defined]
        result["store_bind"] = [s.getsockname()[0] for s in server._server.sockets]
    Path(out, f"{label}_port_{rank}").write_text(f"{w.transport.port} {w.transport.job}")
    if label == "b" and rank == 0:  # while job A runs, reach into it with job B's identity
        while not Path(out, "a_port_1").exists():
            await asyncio.sleep(0.05)
        result["intrusion"] = await _intrude(out)
    await dist.barrier()
    fds0 = fd_count()
    stop = np.zeros(1, np.int64)
    i = 0
    t0 = time.monotonic()
    while True:
        x = np.full(1 << 18, rank + i, np.float32)  # 1 MiB
        await dist.all_reduce(x)
        assert (x == sum(r + i for r in range(size))).all()
        await w.store.set(f"{label}/step/{rank}", str(i))
        assert await w.store.add(f"{label}/counter", 1) >= i
        i += 1
        stop[0] = Path(out, f"stop_{label}").exists() and i >= 20
        await dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        if stop[0]:
            break
        await asyncio.sleep(0.005)
    result.update(steps=i, seconds=time.monotonic() - t0)
    deadline = time.monotonic() + 10
    while fd_count() > fds0 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    result.update(fds0=fds0, fds1=fd_count())
    await dist.destroy_process_group()
    return result


async def _intrude(out: str) -> list[str]:
    """Job B's rank 0 reaches into job A with its own identity: both doors stay shut."""
    port_a, _job_a = Path(out, "a_port_1").read_text().split()
    errors = []
    me = world().transport
    intruder = TcpTransport(0, 2, job=me.job, secret=me.secret)  # type: ignore[attr-defined]
    try:
        await intruder.connect(1, "127.0.0.1", int(port_a), 5.0)
        errors.append("peer port: no error")
    except DistError as exc:
        errors.append(f"peer port: {exc}")
    finally:
        intruder.abort()
    store_a = TCPStore("127.0.0.1", int(Path(out, "store_port_a").read_text()), timeout=5)
    try:
        await store_a.set("evil", b"1")
        errors.append("store: no error")
    except DistError as exc:
        errors.append(f"store: {exc}")
    finally:
        await store_a.aclose()
    return errors


async def _throw_garbage(port: int) -> list[float]:
    async def one(blob: bytes) -> float:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        t0 = time.monotonic()
        if blob:
            writer.write(blob)
        else:
            writer.close()
            return 0.0
        try:
            async with asyncio.timeout(DEADLINE + 5):
                while await reader.read(65536):
                    pass
        except (ConnectionResetError, BrokenPipeError):
            pass
        writer.close()
        return time.monotonic() - t0

    return list(await asyncio.gather(*(one(b) for b in GARBAGE.values())))


async def _flood(ports: list[int], n: int) -> list[float]:
    """``n`` connections dripping one byte a second; how long each survived."""
    conns = []
    for i in range(n):
        conns.append(await asyncio.open_connection("127.0.0.1", ports[i % len(ports)]))
    t0 = time.monotonic()

    async def drip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> float:
        try:
            while True:
                writer.write(b"\x00")
                try:
                    async with asyncio.timeout(1.0):
                        if not await reader.read(65536):
                            break
                except TimeoutError:
                    continue
        except (ConnectionResetError, BrokenPipeError):
            pass
        writer.close()
        return time.monotonic() - t0

    async with asyncio.timeout(DEADLINE + 10):
        return list(await asyncio.gather(*(drip(r, w) for r, w in conns)))


async def _attack(out: Path, store_port: int) -> dict[str, Any]:
    peer_ports = [int(Path(out, f"a_port_{r}").read_text().split()[0]) for r in range(2)]
    report: dict[str, Any] = {}
    report["garbage_store"] = await _throw_garbage(store_port)
    report["garbage_peer"] = await _throw_garbage(peer_ports[1])
    # a wrong secret (row 13): refused with DistError on our side
    wrong = TCPStore("127.0.0.1", store_port, timeout=5, secret=b"not-the-secret")
    t0 = time.monotonic()
    try:
        await wrong.set("k", b"evil")
        report["wrong_store"] = "no error"
    except DistError as exc:
        report["wrong_store"] = str(exc)
    report["wrong_store_took"] = time.monotonic() - t0
    await wrong.aclose()
    job_a = Path(out, "a_port_1").read_text().split()[1]
    rogue = TcpTransport(0, 2, job=job_a, secret=b"not-the-secret")
    try:
        await rogue.connect(1, "127.0.0.1", peer_ports[1], 5.0)
        report["wrong_peer"] = "no error"
    except DistError as exc:
        report["wrong_peer"] = str(exc)
    rogue.abort()
    # 500 slow connections (row 12), on the store port and both peer ports
    report["flood"] = await _flood([store_port, *peer_ports], FLOOD)
    return report


def _wait_for(paths: list[Path], within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"never appeared: {paths}"
        time.sleep(0.05)


def test_jobs_survive_garbage_floods_and_intruders(tmp_path: Path) -> None:
    port_a, port_b = free_port(), free_port()
    Path(tmp_path, "store_port_a").write_text(str(port_a))
    common = {"AIODIST_HANDSHAKE_TIMEOUT": str(DEADLINE)}
    env_a = {**common, "MASTER_PORT": str(port_a), "AIODIST_SECRET": "secret-of-job-a"}
    env_b = {**common, "MASTER_PORT": str(port_b), "AIODIST_SECRET": "secret-of-job-b"}
    with ThreadPoolExecutor(2) as pool:
        job_a = pool.submit(spawn, _job, 2, args=(str(tmp_path), "a"), env=env_a, timeout=100)
        job_b = pool.submit(spawn, _job, 2, args=(str(tmp_path), "b"), env=env_b, timeout=100)
        try:
            _wait_for([tmp_path / f"{j}_port_{r}" for j in "ab" for r in range(2)])
            time.sleep(0.5)  # (job B's rank 0 is knocking on job A's doors meanwhile)
            report = asyncio.run(_attack(tmp_path, port_a))
        finally:
            (tmp_path / "stop_a").touch()
            (tmp_path / "stop_b").touch()
        res_a, res_b = job_a.result(), job_b.result()
    # row 11: every garbage connection dropped within the handshake deadline (+ slack)
    for took in report["garbage_store"] + report["garbage_peer"]:
        assert took < DEADLINE + 1.5, report
    record(11, f"garbage connection dropped (handshake deadline {DEADLINE:g} s)", max(report["garbage_peer"]))
    # row 13: a wrong secret is refused with DistError, fast
    assert "authentication failed" in report["wrong_store"], report
    assert report["wrong_store_took"] < 1.0
    assert "refused" in report["wrong_peer"], report
    record(13, "wrong secret refused (store)", report["wrong_store_took"])
    # row 12: the slow connections were dropped at the deadline, not held
    assert max(report["flood"]) < DEADLINE + 2.5, max(report["flood"])
    record(12, f"{FLOOD} slow connections all dropped (deadline {DEADLINE:g} s)", max(report["flood"]))
    # row 15: job B could not get into job A
    peer, store = res_b[0]["intrusion"]
    assert "refused" in peer and ("belongs to job" in peer or "authentication" in peer), peer
    assert "authentication failed" in store, store
    # both jobs went on and finished, exactly; file descriptors back to baseline (row 12)
    for res in (res_a, res_b):
        for r in res:
            assert r["steps"] >= 20 and r["fds1"] <= r["fds0"], r
            assert r["peer_bind"] == "127.0.0.1"  # row 18: loopback only
        assert res[0]["store_bind"] == ["127.0.0.1"]
    # one rate-limited warning per burst, naming the remote address (and never a flood of them)
    logs = [(tmp_path / f"log_a_{r}").read_text() for r in range(2)]
    warnings = [line for text in logs for line in text.splitlines() if line.startswith("WARNING")]
    assert any("127.0.0.1:" in line for line in warnings), warnings
    assert len(warnings) <= 12, warnings
    assert any("refused 127.0.0.1:" in line and "authentication" in line for line in warnings), warnings


async def _pickle_job(rank: int, size: int, out: str, port2: int, port3: int) -> dict[str, Any]:
    os.environ.pop("AIODIST_SECRET", None)
    os.environ.pop("AIODIST_ALLOW_PICKLE", None)
    await dist.init_process_group("tcp", "env://", timeout=30)
    res: dict[str, Any] = {}
    plain = [{"a": [1, 2.5, "x", b"y", None, True]}, (3, 4)]
    objs = list(plain) if rank == 0 else [None, None]
    await dist.broadcast_object_list(objs, 0)
    res["plain"] = objs
    trap = str(Path(out, "unpickled"))
    objs = [Trap(trap)] if rank == 0 else [None]
    try:
        await dist.broadcast_object_list(objs, 0)
        res["refused"] = "no error"
    except DistError as exc:
        res["refused"] = str(exc)
    res["trap_after_refusal"] = Path(trap).exists()
    # The opt-in is read when a job starts: set while the job runs, it changes nothing.
    os.environ["AIODIST_ALLOW_PICKLE"] = "1"
    objs = [Trap(trap)] if rank == 0 else [None]
    try:
        await dist.broadcast_object_list(objs, 0)
        res["refused_mid_job"] = "no error"
    except DistError as exc:
        res["refused_mid_job"] = str(exc)
    await dist.destroy_process_group()
    # a job started with the opt-in
    os.environ["MASTER_PORT"] = str(port2)
    await dist.init_process_group("tcp", "env://", timeout=30)
    await dist.broadcast_object_list(objs, 0)
    res["trap_after_opt_in"] = Path(trap).exists()
    await dist.barrier()
    if rank == 1:
        Path(trap).unlink()
    await dist.destroy_process_group()
    # authenticated peers may pickle
    os.environ.pop("AIODIST_ALLOW_PICKLE")
    os.environ.update(AIODIST_SECRET="pickle-job-secret", MASTER_PORT=str(port3))
    await dist.init_process_group("tcp", "env://", timeout=30)
    objs = [Trap(trap)] if rank == 0 else [None]
    await dist.broadcast_object_list(objs, 0)
    res["trap_with_secret"] = Path(trap).exists()
    await dist.destroy_process_group()
    return res


def test_pickle_only_from_authenticated_peers_or_with_opt_in(tmp_path: Path) -> None:
    res = spawn(_pickle_job, 2, args=(str(tmp_path), free_port(), free_port()), timeout=90)
    receiver = res[1]
    assert receiver["plain"] == [{"a": [1, 2.5, "x", b"y", None, True]}, (3, 4)]
    assert "not unpickled" in receiver["refused"] and "rank 0" in receiver["refused"]
    assert receiver["trap_after_refusal"] is False  # row 17: a refused pickle never ran
    assert "not unpickled" in receiver["refused_mid_job"]
    assert receiver["trap_after_opt_in"] is True
    assert receiver["trap_with_secret"] is True


def _non_loopback_address() -> str | None:
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route
            addr = str(s.getsockname()[0])
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


async def test_no_secret_on_a_non_loopback_address_warns_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import aiodist.store.server as server_mod

    addr = _non_loopback_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    monkeypatch.setattr(server_mod, "_warned_insecure", False)
    caplog.set_level(logging.WARNING, "aiodist.store")
    for _ in range(2):
        async with server_mod.StoreServer(addr, 0, secret=b""):
            pass
    async with server_mod.StoreServer("127.0.0.1", 0, secret=b""):
        pass
    warnings = [r.getMessage() for r in caplog.records if "no AIODIST_SECRET" in r.getMessage()]
    assert len(warnings) == 1 and addr in warnings[0], warnings
    # with a secret: no warning at all
    monkeypatch.setattr(server_mod, "_warned_insecure", False)
    caplog.clear()
    async with server_mod.StoreServer(addr, 0, secret=b"s"):
        pass
    assert not [r for r in caplog.records if "no AIODIST_SECRET" in r.getMessage()]


async def test_store_client_vanishing_mid_request() -> None:
    from aiodist.wire.frames import FrameReader
    from aiodist.wire.handshake import make_hello, parse_challenge, verify_welcome

    secret = b"mid-request"
    async with TCPStore("127.0.0.1", 0, is_master=True, timeout=5, secret=secret) as master:
        server = master.server
        assert server is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", master.port)
        got: list[Any] = []
        fr = FrameReader(lambda h, n: None, lambda h, p: got.append(h))
        while not got:
            fr.feed(await reader.read(4096))
        challenge = parse_challenge(got.pop())
        hello = make_hello(challenge, "aiodist-store", -1, secret)
        writer.write(encode_frame(hello.pack()))
        while not got:
            fr.feed(await reader.read(4096))
        verify_welcome(challenge, hello, got.pop(), "aiodist-store", secret)
        frame = encode_frame(["set", 1, ["half"], [1000], None], 1000) + b"x" * 400  # 600 bytes short
        writer.write(frame)
        await asyncio.sleep(0.05)
        writer.transport.abort()  # vanish, mid-request
        deadline = time.monotonic() + 5
        while server.num_connections > 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert server.num_connections == 1  # only the master's own client
        assert not await master.check(["half"])
        await master.set("after", b"fine")
        assert await master.get("after") == b"fine"
