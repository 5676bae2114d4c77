"""Stores across real processes: three workers on one TCPStore server and one FileStore file,
and a store server killed while its clients wait (FAULTS #4)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from aiodist.errors import DistStoreError
from aiodist.store import FileStore, TCPStore

pytestmark = pytest.mark.timeout(30)

SECRET = "procs-test-secret"
REPO = str(Path(__file__).resolve().parents[2])

WORKER = """
import json, sys
from aiodist.store.blocking import FileStore, TCPStore

rank, port, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
out = {}
for name, store in (
    ("tcp", TCPStore("127.0.0.1", port, world_size=3, timeout=20)),
    ("file", FileStore(path, 3, timeout=20)),
):
    store.set(f"rank{rank}", str(rank))
    arrived = store.add("arrived", 1)
    keys = [f"rank{r}" for r in range(3)]
    store.wait(keys)
    values = [v.decode() for v in store.multi_get(keys)]
    winner = store.compare_set("winner", "", str(rank)).decode()
    store.append("log", str(rank))
    assert store.get("winner").decode() == winner
    store.add("done", 1)
    store.wait(["all-done"] if name == "tcp" else [])
    out[name] = {"arrived": arrived, "values": values, "winner": winner}
    store.close()
print(json.dumps(out), flush=True)
"""

SERVER = """
import sys, time
from aiodist.store.blocking import TCPStore

store = TCPStore("127.0.0.1", 0, is_master=True, timeout=30)
print(store.port, flush=True)
time.sleep(60)
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["AIODIST_SECRET"] = SECRET
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


async def test_three_processes_share_a_tcp_store_and_a_file(tmp_path: Path) -> None:
    path = tmp_path / "rendezvous"
    async with TCPStore("127.0.0.1", 0, is_master=True, timeout=20, secret=SECRET.encode()) as master:
        procs = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                WORKER,
                str(rank),
                str(master.port),
                str(path),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=_env(),
            )
            for rank in range(3)
        ]
        try:
            # every worker counts itself done, then waits for the master's go, so that the
            # TCP part is proven to run concurrently
            await master.wait(["done"], timeout=20)
            while await master.add("done", 0) < 3:
                await asyncio.sleep(0.01)
            await master.set("all-done", b"")
            outputs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), 20)
        finally:
            for p in procs:
                if p.returncode is None:
                    p.kill()
                    await p.wait()
        for p, (_out, err) in zip(procs, outputs, strict=True):
            assert p.returncode == 0, err.decode()
        results = [json.loads(out) for out, _ in outputs]
        for face in ("tcp", "file"):
            assert sorted(r[face]["arrived"] for r in results) == [1, 2, 3]
            assert all(r[face]["values"] == ["0", "1", "2"] for r in results)
            assert len({r[face]["winner"] for r in results}) == 1
        assert sorted((await master.get("log")).decode()) == ["0", "1", "2"]
        assert await master.get("arrived") == b"3"
    # the last of the three FileStores deleted the file
    assert not path.exists()


async def test_server_process_killed_while_clients_wait() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SERVER, stdout=asyncio.subprocess.PIPE, env=_env()
    )
    try:
        assert proc.stdout is not None
        port = int(await asyncio.wait_for(proc.stdout.readline(), 15))
        client = TCPStore("127.0.0.1", port, timeout=30, secret=SECRET.encode())
        other = TCPStore("127.0.0.1", port, timeout=30, secret=SECRET.encode())
        await client.set("k", b"v")
        assert await other.get("k") == b"v"
        waiting = [
            asyncio.create_task(client.get("never")),
            asyncio.create_task(client.wait(["never"])),
            asyncio.create_task(other.multi_get(["k", "never"])),
        ]
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        for task in waiting:
            with pytest.raises(DistStoreError, match=f"store at 127.0.0.1:{port} closed the connection"):
                await asyncio.wait_for(task, 1.0)
        assert time.monotonic() - t0 < 1.0
        for store in (client, other):
            t1 = time.monotonic()
            with pytest.raises(DistStoreError, match="closed the connection"):
                await store.set("after", b"lost")
            assert time.monotonic() - t1 < 0.1
            await store.aclose()
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def test_filestore_across_processes_with_a_slow_writer(tmp_path: Path) -> None:
    path = tmp_path / "slow"
    writer = (
        "import sys, time\n"
        "from aiodist.store.blocking import FileStore\n"
        "s = FileStore(sys.argv[1])\n"
        "time.sleep(0.3)\n"
        "s.set('late', b'written by a child')\n"
        "s.close()\n"
    )
    async with FileStore(path, timeout=10) as store:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", writer, str(path), env=_env())
        try:
            assert await asyncio.wait_for(store.get("late"), 10) == b"written by a child"
            assert await asyncio.wait_for(proc.wait(), 10) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
