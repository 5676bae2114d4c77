"""Rendezvous faults with real processes on loopback: what holds the master port, ranks that
disagree about the job, progress while waiting, and the network and logging settings.

- a program already listens on MASTER_PORT (silent, answering garbage, or bound and not
  listening): the rank meant to host the store fails within seconds naming host:port and
  "already in use"; the other ranks fail as fast with the same diagnosis; rank 0 never joins it;
- another aiodist job (a different AIODIST_SECRET) holds the port: said so, on both roles;
- WORLD_SIZE 2 on one rank and 3 on another; nodes started with different --nproc-per-node;
- while a rendezvous waits, warnings say who joined, who is missing and for how long;
- AIODIST_HOST / GLOO_SOCKET_IFNAME interface names; AIODIST_LOG_LEVEL.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aiodist as dist
from aiodist.face.world import world
from aiodist.rendezvous import interface_address, local_address_towards
from aiodist.store.client import SILENCE_VERDICT
from aiodist.testing import free_port, spawn
from aiodist.transport.mesh import Identity, world_size_disagreement

pytestmark = pytest.mark.timeout(90)

LONG = 60.0  # the init timeout of the failure cases: every one must fail long before it


# -- a program on the master port ----------------------------------------------------------
class Squatter:
    """A plain TCP listener on 127.0.0.1 that is not aiodist: silent, garbage, or not accepting."""

    def __init__(self, behaviour: str) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.behaviour = behaviour
        self.conns: list[socket.socket] = []
        self.thread: threading.Thread | None = None
        if behaviour == "bound":
            # The port is the local end of an open connection: taken, and nobody accepts there.
            self.sock.listen(1)
            client = socket.create_connection(("127.0.0.1", self.port))
            self.conns += [client, self.sock.accept()[0]]
            self.port = int(client.getsockname()[1])
        else:
            self.sock.listen(64)
            self.sock.settimeout(0.2)
            self.stop = threading.Event()
            self.thread = threading.Thread(target=self._serve, daemon=True)
            self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.behaviour == "garbage":
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
            self.conns.append(conn)  # held open, never answered

    def close(self) -> None:
        if self.thread is not None:
            self.stop.set()
            self.thread.join(5)
        for c in self.conns:
            c.close()
        self.sock.close()


@pytest.fixture
def squatter(request: pytest.FixtureRequest) -> Iterator[Squatter]:
    s = Squatter(request.param)
    try:
        yield s
    finally:
        s.close()


async def _init_outcome(
    rank: int, size: int, env: dict[int, dict[str, str]] | None = None
) -> tuple[str, str, float]:
    """Try to join (with ``env[rank]`` added to the environment): (error class, message, seconds)."""
    os.environ.update((env or {}).get(rank, {}))
    t0 = time.monotonic()
    try:
        await dist.init_process_group("tcp", "env://", timeout=LONG)
    except dist.DistError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0
    await dist.destroy_process_group()
    return "no error", "", time.monotonic() - t0


@pytest.mark.parametrize("squatter", ["silent", "garbage"], indirect=True)
def test_a_program_on_the_master_port_fails_every_rank_fast(squatter: Squatter) -> None:
    res = spawn(_init_outcome, 2, env={"MASTER_PORT": str(squatter.port)}, timeout=60)
    addr = f"127.0.0.1:{squatter.port}"
    for rank, (kind, msg, took) in enumerate(res):
        assert kind == "ForeignStoreError", (rank, kind, msg)
        role = "cannot host" if rank == 0 else "cannot join"
        assert f"rank {rank} {role} the store at {addr}" in msg, msg
        assert "already in use by another program" in msg and "--master-port" in msg, msg
        assert took < SILENCE_VERDICT + 5, (rank, took)  # seconds, not the 60 s timeout
    if squatter.behaviour == "garbage":
        assert "SSH-2.0" in res[0][1], res[0][1]


@pytest.mark.parametrize("squatter", ["bound"], indirect=True)
def test_a_port_bound_but_not_listening_fails_the_host_fast(squatter: Squatter) -> None:
    """The port is taken (here: the local end of a connection) and nobody accepts there."""
    res = spawn(_init_outcome, 1, env={"MASTER_PORT": str(squatter.port)}, timeout=60)
    kind, msg, took = res[0]
    assert kind == "DistStoreError", (kind, msg)
    assert f"rank 0 cannot host the store at 127.0.0.1:{squatter.port}" in msg, msg
    assert "already in use by another program" in msg and "--standalone" in msg, msg
    assert took < 15, took


# -- another aiodist job holds the port ------------------------------------------------------
async def _two_secrets(rank: int, size: int, port: int, out: str, same_secret: bool = False) -> Any:
    """Processes 0, 1: job A (secret A) on ``port``; processes 2, 3: job B (secret B), same port."""
    job, my_rank = ("A", rank) if rank < 2 else ("B", rank - 2)
    os.environ["AIODIST_SECRET"] = "shared" if same_secret else f"secret-of-{job}"
    a_ready, b_done = Path(out, "a-ready"), Path(out, "b-done")
    if job == "A":
        await dist.init_process_group(
            "tcp", f"tcp://127.0.0.1:{port}", rank=my_rank, world_size=2, timeout=LONG
        )
        a_ready.touch()
        while not b_done.exists():  # job A keeps the port until job B has tried it
            await asyncio.sleep(0.05)
        t = np.ones(1)
        await dist.all_reduce(t)
        await dist.destroy_process_group()
        return float(t[0])
    while not a_ready.exists():
        await asyncio.sleep(0.05)
    t0 = time.monotonic()
    try:
        await dist.init_process_group(
            "tcp", f"tcp://127.0.0.1:{port}", rank=my_rank, world_size=2, timeout=LONG
        )
        return "joined"
    except dist.DistError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0
    finally:
        Path(out, f"b{my_rank}").touch()
        if all(Path(out, f"b{r}").exists() for r in range(2)):
            b_done.touch()


def test_another_job_with_another_secret_holds_the_port(tmp_path: Path) -> None:
    port = free_port()
    res = spawn(_two_secrets, 4, args=(port, str(tmp_path)), timeout=60)
    assert res[:2] == [2.0, 2.0]  # job A never noticed
    addr = f"127.0.0.1:{port}"
    (k0, host_msg, t0), (k1, join_msg, t1) = res[2], res[3]
    assert k0 == k1 == "ForeignStoreError"
    assert f"rank 0 cannot host the store at {addr}" in host_msg, host_msg
    assert "already in use by another aiodist job" in host_msg and "AIODIST_SECRET" in host_msg, host_msg
    assert f"rank 1 cannot join the store at {addr}" in join_msg, join_msg
    assert f"Another aiodist job (with a different AIODIST_SECRET) holds {addr}" in join_msg, join_msg
    assert "--master-port" in host_msg and "--master-port" in join_msg
    assert max(t0, t1) < 10, (t0, t1)


def test_another_job_with_the_same_secret_and_group_name_is_named(tmp_path: Path) -> None:
    port = free_port()
    res = spawn(_two_secrets, 4, args=(port, str(tmp_path), True), timeout=60)
    assert res[:2] == [2.0, 2.0]  # job A never noticed
    for kind, msg, took in res[2:]:
        assert kind in ("DistValueError", "DistError") and f"127.0.0.1:{port}" in msg, msg
        assert "same group name" in msg and "choose another port, or another group_name" in msg, msg
        assert took < 10, took


# -- ranks that disagree about the job --------------------------------------------------------
def test_world_size_disagreement_is_named_on_every_rank() -> None:
    job = {0: {"WORLD_SIZE": "2"}, 1: {"WORLD_SIZE": "3"}}
    res = spawn(_init_outcome, 2, args=(job,), timeout=60)
    for _, msg, took in res:
        assert re.search(
            r"rank 1 says world_size 3, rank 0 says 2|rank 0 says world_size 2, rank 1 says 3", msg
        ), msg
        assert took < 10, took


def _node(rank: int, world_size: int, node: int, local_rank: int, per_node: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "GROUP_RANK": str(node),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(per_node),
    }


NODE_CASES = {
    # As two launchers set them: node 0 with --nproc-per-node 2, node 1 with 1 (--nnodes 2 both).
    "nproc-per-node": (
        {0: _node(0, 4, 0, 0, 2), 1: _node(1, 4, 0, 1, 2), 2: _node(1, 2, 1, 0, 1)},
        ["the nodes disagree: node 0 runs 2 processes per node, node 1 runs 1", "--nproc-per-node"],
    ),
    # --nnodes 3, node 1 started twice, node 2 not yet: both claimants of rank 1 must meet.
    "node-rank": (
        {0: _node(0, 3, 0, 0, 1), 1: _node(1, 3, 1, 0, 1), 2: _node(1, 3, 1, 0, 1)},
        ["two processes claim rank 1: pid", "two nodes were started with --node-rank 1"],
    ),
}


@pytest.mark.parametrize("case", list(NODE_CASES))
def test_nodes_that_disagree_are_told_apart(case: str) -> None:
    job, expected = NODE_CASES[case]
    res = spawn(_init_outcome, 3, args=(job,), timeout=60)
    for _, msg, took in res:
        assert all(e in msg for e in expected), msg
        assert took < 10, took


def test_disagreeing_nodes_read_the_same_whichever_rank_reports() -> None:
    node0 = Identity(0, 4, "h0", 10, node=0, local_rank=0, local_world_size=2)
    node1 = Identity(1, 2, "h1", 11, node=1, local_rank=0, local_world_size=1)
    said = {world_size_disagreement(node0, node1), world_size_disagreement(node1, node0)}
    for msg in said:
        assert "the nodes disagree: node 0 runs 2 processes per node, node 1 runs 1" in msg, msg


# -- progress while a rendezvous waits ---------------------------------------------------------
class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


async def _waiting(rank: int, size: int) -> list[str]:
    handler = _Collect()
    logger = logging.getLogger("aiodist")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    if rank == 2:
        return []  # never joins
    try:
        await dist.init_process_group("tcp", "env://", timeout=4)
    except dist.DistError as exc:
        return [f"{type(exc).__name__}: {exc}", *handler.lines]
    return ["no error"]


def test_a_waiting_rendezvous_says_who_is_missing_at_intervals() -> None:
    res = spawn(_waiting, 3, env={"AIODIST_RENDEZVOUS_LOG_INTERVAL": "0.6"}, timeout=60)
    for rank in (0, 1):
        error, *lines = res[rank]
        assert error.startswith("DistTimeoutError") and "joined 2 of 3, missing rank 2" in error, res[rank]
        waits = [ln for ln in lines if ln.startswith("WARNING") and "has waited" in ln]
        assert len(waits) >= 2, lines
        assert all(
            f"rank {rank} has waited" in ln and "2 of 3 ranks joined, missing rank 2" in ln for ln in waits
        )
        role = "hosts the store at" if rank == 0 else "joined the store at"
        assert any(ln.startswith("INFO") and role in ln for ln in lines), lines
        assert any(f"rank {rank} of 3 claimed" in ln for ln in lines), lines


async def _connected(rank: int, size: int) -> list[str]:
    handler = _Collect()
    logging.getLogger("aiodist").addHandler(handler)
    logging.getLogger("aiodist").setLevel(logging.INFO)
    await dist.init_process_group("tcp", "env://", timeout=30)
    await dist.destroy_process_group()
    return handler.lines


def test_info_lines_say_where_the_store_is_and_how_the_mesh_connected() -> None:
    res = spawn(_connected, 2, timeout=60)
    assert any("rank 0 connected with the 1 peer(s) of its host" in ln for ln in res[0]), res[0]
    assert any("rank 1 connected with the 1 peer(s) of its host" in ln for ln in res[1]), res[1]


async def _no_store(rank: int, size: int) -> list[str]:
    handler = _Collect()
    logging.getLogger("aiodist").addHandler(handler)
    with pytest.raises(dist.DistStoreError, match="could not connect"):
        await dist.init_process_group("tcp", "env://", rank=1, world_size=2, timeout=2.5)
    return handler.lines


def test_waiting_for_the_store_is_reported_too() -> None:
    res = spawn(_no_store, 1, env={"AIODIST_RENDEZVOUS_LOG_INTERVAL": "0.8"}, timeout=60)
    waits = [ln for ln in res[0] if "has waited" in ln]
    assert waits and all("rank 1 has waited" in ln and "for the store at 127.0.0.1:" in ln for ln in waits)
    assert "ConnectionRefusedError" in waits[-1], waits


# -- where peers listen: AIODIST_HOST and GLOO_SOCKET_IFNAME -----------------------------------
def test_interface_names_resolve_and_unknown_ones_list_the_interfaces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert interface_address("lo", "AIODIST_HOST=lo") == "127.0.0.1"
    monkeypatch.setenv("AIODIST_HOST", "lo")
    assert local_address_towards("10.1.2.3") == "127.0.0.1"
    monkeypatch.setenv("AIODIST_HOST", "nosuchif0")
    with pytest.raises(dist.DistValueError, match=r"AIODIST_HOST=nosuchif0: .*\blo\b"):
        local_address_towards("10.1.2.3")
    monkeypatch.delenv("AIODIST_HOST")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert local_address_towards("10.1.2.3") == "127.0.0.1"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuchif0")
    with pytest.raises(
        dist.DistValueError,
        match=r"GLOO_SOCKET_IFNAME=nosuchif0: this machine has no network interface 'nosuchif0' \(it has: .*lo",
    ):
        local_address_towards("10.1.2.3")


async def _listen_on(rank: int, size: int) -> tuple[str, float]:
    await dist.init_process_group("tcp", "env://", timeout=30)
    t = np.ones(1)
    await dist.all_reduce(t)
    host = world().host
    await dist.destroy_process_group()
    return host, float(t[0])


@pytest.mark.parametrize("var", ["AIODIST_HOST", "GLOO_SOCKET_IFNAME"])
def test_a_job_listens_on_the_named_interface(var: str) -> None:
    assert spawn(_listen_on, 2, env={var: "lo"}) == [("127.0.0.1", 2.0)] * 2


def test_an_unknown_interface_fails_the_job_fast() -> None:
    res = spawn(_init_outcome, 2, env={"AIODIST_HOST": "eth9"}, timeout=60)
    for kind, msg, took in res:
        assert kind in ("DistValueError", "DistError"), (kind, msg)
        assert "AIODIST_HOST=eth9" in msg and "lo" in msg, msg
        assert took < 10, took


# -- AIODIST_LOG_LEVEL ------------------------------------------------------------------------
_ONE_RANK = """
import asyncio, aiodist as dist
async def main():
    await dist.init_process_group("tcp", "env://", rank=0, world_size=1, timeout=10)
    await dist.destroy_process_group()
asyncio.run(main())
"""


def _one_rank(level: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, AIODIST_LOG_LEVEL=level, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return subprocess.run(
        [sys.executable, "-c", _ONE_RANK], env=env, capture_output=True, text=True, timeout=60
    )


def test_log_level_from_the_environment() -> None:
    info = _one_rank("info")
    assert info.returncode == 0, info.stderr
    assert re.search(r"INFO aiodist: aiodist: rank 0 hosts the store at 127\.0\.0\.1:\d+", info.stderr), (
        info.stderr
    )
    assert "rank 0 of 1 claimed" in info.stderr
    quiet = _one_rank("WARNING")
    assert quiet.returncode == 0 and "INFO" not in quiet.stderr, quiet.stderr
    bad = _one_rank("chatty")
    assert bad.returncode != 0 and "AIODIST_LOG_LEVEL='chatty'" in bad.stderr, bad.stderr
