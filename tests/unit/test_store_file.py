"""FileStore specifics: several stores on one file, cleanup by the last of world_size, bad files."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import pytest

from aiodist.errors import DistStoreError, DistTypeError, DistValueError
from aiodist.store import FileStore, blocking

pytestmark = pytest.mark.timeout(20)


async def test_stores_on_one_file_see_each_other(tmp_path: Path) -> None:
    path = tmp_path / "shared"
    a, b = FileStore(path, timeout=5), FileStore(str(path), timeout=5)
    async with a, b:
        getter = asyncio.create_task(b.get("k"))
        await asyncio.sleep(0.05)
        await a.set("k", b"from a")
        assert await asyncio.wait_for(getter, 2) == b"from a"
        assert await b.compare_set("k", "from a", "from b") == b"from b"
        assert await a.get("k") == b"from b"
        assert await a.delete_key("k")
        assert not await b.check(["k"])
        assert not await b.delete_key("k")
        await a.append("log", b"a")
        await b.append("log", b"b")
        assert await a.get("log") == b"ab"
        assert await a.num_keys() == await b.num_keys() == 1


async def test_concurrent_adds_through_two_files_are_atomic(tmp_path: Path) -> None:
    path = tmp_path / "counter"
    a, b = FileStore(path), FileStore(path)
    async with a, b:
        results = await asyncio.gather(*(s.add("n", 1) for _ in range(100) for s in (a, b)))
        assert sorted(results) == list(range(1, 201))


async def test_last_of_world_size_deletes_the_file(tmp_path: Path) -> None:
    path = tmp_path / "rdzv"
    stores = [FileStore(path, world_size=3) for _ in range(3)]
    for s in stores:
        await s.start()
    await stores[0].set("k", b"v")
    await stores[0].aclose()
    await stores[1].aclose()
    assert path.exists()
    assert await stores[2].get("k") == b"v"
    await stores[2].aclose()
    assert not path.exists()


async def test_without_world_size_the_file_stays(tmp_path: Path) -> None:
    path = tmp_path / "kept"
    async with FileStore(path) as s:
        await s.set("k", b"v")
    assert path.exists()
    async with FileStore(path, timeout=1) as again:
        assert await again.get("k") == b"v"


async def test_abort_leaves_the_file(tmp_path: Path) -> None:
    path = tmp_path / "aborted"
    s = FileStore(path, world_size=1)
    await s.start()
    s.abort()
    assert path.exists()
    with pytest.raises(DistStoreError, match="closed"):
        await s.set("k", b"v")


async def test_stale_file_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "stale"
    first = FileStore(path, world_size=1)
    await first.start()
    second = FileStore(path, world_size=1)
    with pytest.raises(DistStoreError, match="more than world_size=1"):
        await second.start()
    first.abort()


async def test_a_foreign_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "foreign"
    path.write_bytes(b"this is not a store, just some text\n")
    with pytest.raises(DistStoreError, match="not a FileStore file"):
        await FileStore(path).start()
    with pytest.raises(DistStoreError, match="could not open"):
        await FileStore(tmp_path / "no-such-dir" / "f").start()


async def test_lazy_start_and_bad_arguments(tmp_path: Path) -> None:
    path = tmp_path / "lazy"
    s = FileStore(path, world_size=1)
    assert not path.exists()
    await s.set("k", b"v")  # opens on first use
    assert path.exists()
    await s.aclose()
    with pytest.raises(DistTypeError):
        FileStore(3)  # type: ignore[arg-type]
    with pytest.raises(DistValueError):
        FileStore(path, world_size=0)


def test_blocking_store_dropped_without_close_still_cleans_up(tmp_path: Path) -> None:
    path = tmp_path / "dropped"
    s = blocking.FileStore(str(path), world_size=1)
    s.set("k", b"v")
    assert s.path == str(path) and path.exists()
    del s
    gc.collect()
    assert not path.exists()
