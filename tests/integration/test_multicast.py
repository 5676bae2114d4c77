"""Multicast rendezvous (``tcp://<multicast group>:port``): codec, state machine, real sockets."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from aiodist.errors import DistError, DistTimeoutError, DistValueError
from aiodist.rendezvous.multicast import (
    MAX_DATAGRAM,
    Announcement,
    DatagramError,
    Discovery,
    _Rendezvous,
    decode_announcement,
    discover,
    encode_announcement,
    is_multicast_address,
)

REPO = Path(__file__).resolve().parents[2]
LOOPBACK = "127.0.0.1"


def _loopback_multicast_works() -> bool:
    """Send one datagram to a group on loopback and see whether a member socket receives it."""
    group, port = _fresh_group()
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        rx.bind((group, port))
        rx.setsockopt(
            socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, socket.inet_aton(group) + socket.inet_aton(LOOPBACK)
        )
        rx.settimeout(1.0)
        tx.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(LOOPBACK))
        tx.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
        tx.sendto(b"probe", (group, port))
        return rx.recv(16) == b"probe"
    except OSError:
        return False
    finally:
        rx.close()
        tx.close()


def _fresh_group() -> tuple[str, int]:
    """A random administratively scoped group and a currently free UDP port, so tests never meet."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"239.255.{random.randrange(1, 255)}.{random.randrange(1, 255)}", port


needs_multicast = pytest.mark.skipif(
    not _loopback_multicast_works(),
    reason=(
        "UDP multicast on loopback does not work on this host; as root: "
        "`ip link set lo multicast on && ip route add 224.0.0.0/4 dev lo`"
    ),
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIODIST_SECRET", raising=False)
    monkeypatch.delenv("AIODIST_MULTICAST_IF", raising=False)


@pytest.fixture
def group() -> tuple[str, int]:
    return _fresh_group()


def _close(results: list[Any]) -> None:
    for r in results:
        if isinstance(r, Discovery) and r.listen_sock is not None:
            r.listen_sock.close()


def _check_job(results: list[Any], world_size: int) -> None:
    """Distinct ranks 0..n-1, one master everyone agrees on, and only rank 0 holds its socket."""
    assert all(isinstance(r, Discovery) for r in results), results
    assert sorted(r.rank for r in results) == list(range(world_size))
    assert {r.world_size for r in results} == {world_size}
    assert len({(r.master_addr, r.master_port) for r in results}) == 1
    for r in results:
        if r.rank == 0:
            assert r.listen_sock is not None
            assert r.listen_sock.getsockname() == (r.master_addr, r.master_port)
        else:
            assert r.listen_sock is None


# --------------------------------------------------------------------------- pure pieces


def test_is_multicast_address() -> None:
    for host in ("224.0.0.1", "239.255.10.10", "239.0.0.0", "239.255.255.255"):
        assert is_multicast_address(host)
    for host in ("223.255.255.255", "240.0.0.1", "127.0.0.1", "localhost", "ff02::1", "", "239.1.1"):
        assert not is_multicast_address(host)


def _ann(roster: tuple[bytes, ...] = (), **kw: Any) -> Announcement:
    fields: dict[str, Any] = {
        "group_name": "job",
        "world_size": 3,
        "member_id": bytes(range(16)),
        "host": "10.1.2.3",
        "port": 4242,
    }
    fields.update(kw)
    return Announcement(roster=roster, **fields)


@pytest.mark.parametrize("secret", [None, b"s3cret"])
def test_codec_roundtrip(secret: bytes | None) -> None:
    ids = sorted(os.urandom(16) for _ in range(3))
    for ann in (_ann(), _ann(member_id=ids[1], roster=tuple(ids)), _ann(group_name="ünïcode", world_size=1)):
        assert decode_announcement(encode_announcement(ann, secret), secret) == ann


def test_codec_authentication() -> None:
    data = encode_announcement(_ann(), b"right")
    for wrong in (b"wrong", None):
        with pytest.raises(DatagramError, match="authentication"):
            decode_announcement(data, wrong)
    # A job without a secret ignores authenticated traffic too: it is not its job.
    with pytest.raises(DatagramError, match="authentication"):
        decode_announcement(encode_announcement(_ann(), b"right"), None)


@pytest.mark.parametrize("secret", [None, b"k"])
def test_codec_every_truncation_rejected(secret: bytes | None) -> None:
    data = encode_announcement(_ann(roster=(bytes(range(16)),), world_size=1), secret)
    for cut in range(len(data)):
        with pytest.raises(DatagramError):
            decode_announcement(data[:cut], secret)


def test_codec_every_byte_flip_rejected_with_secret() -> None:
    data = encode_announcement(_ann(), b"k")
    for i in range(len(data)):
        mangled = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]
        with pytest.raises(DatagramError):
            decode_announcement(mangled, b"k")


def _envelope(body_fields: Any, *, magic: Any = "aiodist-mc", version: Any = 1) -> bytes:
    body = msgpack.packb(body_fields, use_bin_type=True)
    return bytes(msgpack.packb([magic, version, body, b""], use_bin_type=True))


@pytest.mark.parametrize(
    "datagram",
    [
        b"",
        b"\xc1",
        b"hello world",
        msgpack.packb({"a": 1}),
        msgpack.packb(["aiodist-mc", 1, b"x"]),
        b"\x00" * (MAX_DATAGRAM + 1),
        _envelope(["job", 3, bytes(16), "10.0.0.1", 1, []], magic="other"),
        _envelope(["job", 3, bytes(16), "10.0.0.1", 1, []], version=2),
        _envelope(["job", 0, bytes(16), "10.0.0.1", 1, []]),
        _envelope(["job", True, bytes(16), "10.0.0.1", 1, []]),
        _envelope(["job", 3, bytes(15), "10.0.0.1", 1, []]),
        _envelope(["job", 3, bytes(16), "239.1.1.1", 1, []]),
        _envelope(["job", 3, bytes(16), "0.0.0.0", 1, []]),
        _envelope(["job", 3, bytes(16), "example.com", 1, []]),
        _envelope(["job", 3, bytes(16), "10.0.0.1", 0, []]),
        _envelope(["job", 3, bytes(16), "10.0.0.1", 70000, []]),
        _envelope(["job", 3, bytes(16), "10.0.0.1", 1, []][:5]),
        _envelope(["job", 2, b"\x01" * 16, "10.0.0.1", 1, [b"\x02" * 16, b"\x01" * 16]]),  # unsorted
        _envelope(["job", 2, b"\x03" * 16, "10.0.0.1", 1, [b"\x01" * 16, b"\x02" * 16]]),  # sender absent
        _envelope(["job", 3, b"\x01" * 16, "10.0.0.1", 1, [b"\x01" * 16, b"\x02" * 16]]),  # wrong length
        _envelope(["job", 2, b"\x01" * 16, "10.0.0.1", 1, [b"\x01" * 16, 7]]),
        _envelope(["x" * 300, 3, bytes(16), "10.0.0.1", 1, []]),
    ],
)
def test_codec_rejects_malformed(datagram: bytes) -> None:
    with pytest.raises(DatagramError):
        decode_announcement(datagram, None)


def _member(i: int, world_size: int = 3, roster: tuple[bytes, ...] = ()) -> Announcement:
    return _ann(member_id=bytes([i]) * 16, world_size=world_size, port=1000 + i, roster=roster)


def test_rendezvous_settles_then_fixes_ranks() -> None:
    me = _member(2)
    state = _Rendezvous(me, where="g", settle=0.5)
    state.feed(_member(3), 0.0)
    state.feed(_member(1), 0.1)
    state.tick(0.5)
    assert state.roster is None  # still settling: an extra member would be an error
    state.tick(0.6)
    assert state.roster == (bytes([1]) * 16, bytes([2]) * 16, bytes([3]) * 16)
    rank, master = state.result()
    assert (rank, master.port) == (1, 1001)
    assert not state.done
    roster = state.roster
    assert roster is not None
    state.feed(_member(1, roster=roster), 0.7)
    state.feed(_member(3, roster=roster), 0.7)
    assert state.done


def test_rendezvous_adopts_matching_claim_without_settling() -> None:
    roster = tuple(bytes([i]) * 16 for i in (1, 2, 3))
    state = _Rendezvous(_member(2), where="g", settle=10.0)
    state.feed(_member(1, roster=roster), 0.0)
    state.tick(0.0)
    assert state.roster is None  # member 3 not heard yet
    state.feed(_member(3), 0.1)
    state.tick(0.1)
    assert state.roster == roster


def test_rendezvous_ignores_finished_job_without_us() -> None:
    other = tuple(bytes([i]) * 16 for i in (1, 3, 4))
    state = _Rendezvous(_member(2), where="g")
    state.feed(_member(1), 0.0)
    state.feed(_member(1, roster=other), 0.1)  # member 1 finished without us: an earlier job
    state.feed(_member(3, world_size=7, roster=other), 0.1)  # even its world size is irrelevant
    assert state.found == 1
    assert state.excluded_by == {bytes([1]) * 16, bytes([3]) * 16}


def test_rendezvous_errors() -> None:
    state = _Rendezvous(_member(2), where="g")
    with pytest.raises(DistError, match="world_size=4, this process 3"):
        state.feed(_member(1, world_size=4), 0.0)

    state = _Rendezvous(_member(2), where="g")
    state.feed(_member(1), 0.0)
    state.feed(_member(3), 0.0)
    with pytest.raises(DistValueError, match="found 4 members but world_size is 3"):
        state.feed(_member(4), 0.0)

    state = _Rendezvous(_member(2), where="g", settle=0.0)
    state.feed(_member(1), 0.0)
    state.feed(_member(3), 0.0)
    state.tick(0.0)
    with pytest.raises(DistError, match="disagree"):
        state.feed(_member(1, roster=tuple(bytes([i]) * 16 for i in (1, 2, 4))), 0.1)


def test_rendezvous_forgets_silent_members_and_ignores_latecomers() -> None:
    state = _Rendezvous(_member(2), where="g", settle=0.0)
    state.feed(_member(1), 0.0)
    state.tick(10.0)
    assert state.found == 1
    state.feed(_member(1), 10.0)
    state.feed(_member(3), 10.0)
    state.tick(10.0)
    assert state.roster is not None
    state.feed(_member(4), 10.1)  # a later job on the same address: not ours, not an error
    assert state.result()[0] == 1


# --------------------------------------------------------------------------- real sockets, one process


@needs_multicast
@pytest.mark.timeout(20)
@pytest.mark.parametrize("world_size", [1, 2, 5])
async def test_discover_in_process(group: tuple[str, int], world_size: int) -> None:
    addr, port = group
    results = await asyncio.gather(
        *(discover(addr, port, world_size, timeout=5, interface=LOOPBACK) for _ in range(world_size))
    )
    try:
        _check_job(list(results), world_size)
        assert results[0].master_addr == LOOPBACK
    finally:
        _close(list(results))


@needs_multicast
@pytest.mark.timeout(20)
async def test_interface_from_environment(group: tuple[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIODIST_MULTICAST_IF", LOOPBACK)
    result = await discover(*group, 1, timeout=5)
    _close([result])
    assert (result.rank, result.master_addr) == (0, LOOPBACK)
    monkeypatch.setenv("AIODIST_MULTICAST_IF", "eth-nonsense")
    with pytest.raises(DistValueError, match="AIODIST_MULTICAST_IF"):
        await discover(*group, 1, timeout=5)


@needs_multicast
@pytest.mark.timeout(20)
async def test_group_names_keep_jobs_apart(group: tuple[str, int]) -> None:
    addr, port = group
    jobs = {"alpha": 3, "beta": 2, "gamma": 1}
    calls = [
        discover(addr, port, n, group_name=name, timeout=5, interface=LOOPBACK)
        for name, n in jobs.items()
        for _ in range(n)
    ]
    results = list(await asyncio.gather(*calls))
    try:
        masters = set()
        for n in jobs.values():
            mine = [r for r in results if r.world_size == n]
            _check_job(mine, n)
            masters.add((mine[0].master_addr, mine[0].master_port))
        assert len(masters) == len(jobs)
    finally:
        _close(results)


@needs_multicast
@pytest.mark.timeout(20)
@pytest.mark.parametrize("intruder_secret", [b"not-the-secret", b""])
async def test_wrong_secret_is_ignored(
    group: tuple[str, int], monkeypatch: pytest.MonkeyPatch, intruder_secret: bytes
) -> None:
    addr, port = group
    monkeypatch.setenv("AIODIST_SECRET", "the-secret")  # the members read it (secret=None)
    members = [discover(addr, port, 3, timeout=5, interface=LOOPBACK) for _ in range(3)]
    intruder = discover(addr, port, 3, timeout=1.0, interface=LOOPBACK, secret=intruder_secret)
    *results, failure = await asyncio.gather(*members, intruder, return_exceptions=True)
    try:
        # Had the intruder been counted, the members would have seen 4 of 3 and failed.
        _check_job(results, 3)
        assert isinstance(failure, DistTimeoutError)
        assert "found 1 of 3" in str(failure)
        assert "failed authentication" in str(failure)
    finally:
        _close(results)


@needs_multicast
@pytest.mark.timeout(20)
async def test_timeout_names_found_and_expected(group: tuple[str, int]) -> None:
    addr, port = group
    start = time.monotonic()
    results = await asyncio.gather(
        *(discover(addr, port, 3, timeout=0.6, interface=LOOPBACK) for _ in range(2)), return_exceptions=True
    )
    assert time.monotonic() - start < 1.5
    for r in results:
        assert isinstance(r, DistTimeoutError), r
        assert f"multicast rendezvous on {addr}:{port} found 2 of 3 members" in str(r)


@needs_multicast
@pytest.mark.timeout(20)
async def test_more_members_than_world_size(group: tuple[str, int]) -> None:
    addr, port = group
    results = await asyncio.gather(
        *(discover(addr, port, 2, timeout=3, interface=LOOPBACK) for _ in range(3)), return_exceptions=True
    )
    _close(list(results))
    assert any(
        isinstance(r, DistValueError) and "found 3 members but world_size is 2" in str(r) for r in results
    )


@needs_multicast
@pytest.mark.timeout(20)
async def test_world_size_disagreement(group: tuple[str, int]) -> None:
    addr, port = group
    results = await asyncio.gather(
        discover(addr, port, 2, timeout=3, interface=LOOPBACK),
        discover(addr, port, 3, timeout=3, interface=LOOPBACK),
        return_exceptions=True,
    )
    _close(list(results))
    assert all(isinstance(r, DistError) and "expects world_size=" in str(r) for r in results), results


@needs_multicast
@pytest.mark.timeout(20)
async def test_garbage_on_the_group_port_is_ignored(group: tuple[str, int]) -> None:
    addr, port = group
    rng = random.Random(7)
    valid = encode_announcement(_ann(group_name="other-job"), None)
    garbage = [
        b"",
        b"\xff" * 64,
        b"\x00" * (MAX_DATAGRAM + 100),
        valid[:-3],
        msgpack.packb(["aiodist-mc", 1, b"\x93", b""]),
        _envelope(["default", 3, bytes(16), "10.0.0.1", 1, [bytes(16), 7]]),
        encode_announcement(_ann(group_name="default", world_size=3), b"forged"),
    ]
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(LOOPBACK))
    tx.setblocking(False)

    async def spray() -> None:
        while True:
            for datagram in [*garbage, rng.randbytes(rng.randrange(1, 2000))]:
                tx.sendto(datagram, (addr, port))
            await asyncio.sleep(0.002)

    sprayer = asyncio.create_task(spray())
    try:
        results = list(
            await asyncio.gather(*(discover(addr, port, 3, timeout=5, interface=LOOPBACK) for _ in range(3)))
        )
    finally:
        sprayer.cancel()
        tx.close()
    try:
        _check_job(results, 3)
    finally:
        _close(results)


@pytest.mark.timeout(10)
async def test_argument_validation() -> None:
    with pytest.raises(DistValueError, match="not an IPv4 multicast"):
        await discover("10.0.0.1", 1234, 2, timeout=1)
    with pytest.raises(DistValueError, match="world_size"):
        await discover("239.1.1.1", 1234, 0, timeout=1)
    with pytest.raises(DistValueError, match="port"):
        await discover("239.1.1.1", 0, 2, timeout=1)
    with pytest.raises(DistValueError, match="timeout"):
        await discover("239.1.1.1", 1234, 2, timeout=0)
    with pytest.raises(DistValueError, match="interface"):
        await discover("239.1.1.1", 1234, 2, timeout=1, interface="239.1.1.2")


@needs_multicast
@pytest.mark.timeout(10)
async def test_cancellation_stops_cleanly(group: tuple[str, int]) -> None:
    task = asyncio.create_task(discover(*group, 2, timeout=5, interface=LOOPBACK))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The group port is free for the next job, which completes on its own.
    result = await discover(*group, 1, timeout=5, interface=LOOPBACK)
    _close([result])


# --------------------------------------------------------------------------- real processes

_CHILD = r"""
import asyncio, json, sys
from aiodist.rendezvous.multicast import discover

addr, port, world_size, loop_kind = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

async def main():
    d = await discover(addr, port, world_size, timeout=10, interface="127.0.0.1")
    heard = []
    if d.listen_sock is not None:
        loop = asyncio.get_running_loop()
        for _ in range(world_size - 1):
            conn, _ = await asyncio.wait_for(loop.sock_accept(d.listen_sock), 10)
            heard.append(int((await asyncio.wait_for(loop.sock_recv(conn, 16), 10)).decode()))
            conn.close()
        d.listen_sock.close()
    else:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(d.master_addr, d.master_port), 10)
        writer.write(str(d.rank).encode())
        await writer.drain()
        writer.close()
        await writer.wait_closed()
    print(json.dumps({"rank": d.rank, "master": [d.master_addr, d.master_port], "heard": sorted(heard)}))

if loop_kind == "uvloop":
    import uvloop
    uvloop.run(main())
else:
    asyncio.run(main())
"""


@pytest.fixture
def child_env() -> Iterator[dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if k not in ("AIODIST_SECRET", "AIODIST_MULTICAST_IF")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    yield env


@needs_multicast
@pytest.mark.timeout(40)
def test_three_processes(group: tuple[str, int], child_env: dict[str, str]) -> None:
    addr, port = group
    world_size = 3
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, addr, str(port), str(world_size), loop_kind],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env,
            cwd=REPO,
        )
        for loop_kind in ("asyncio", "uvloop", "asyncio")
    ]
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=30)
            assert p.returncode == 0, err
            outputs.append(json.loads(out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert sorted(o["rank"] for o in outputs) == list(range(world_size))
    assert len({tuple(o["master"]) for o in outputs}) == 1
    assert outputs[0]["master"][0] == LOOPBACK
    # Rank 0's socket accepted a connection from each other process.
    (root,) = [o for o in outputs if o["rank"] == 0]
    assert root["heard"] == list(range(1, world_size))
