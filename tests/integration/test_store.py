"""Every store, both faces: the contract of ``aiodist.store.Store`` (SPEC §2).

Each async test runs against HashStore, FileStore, a TCPStore client of an in-process master,
and PrefixStores over a HashStore and over a TCPStore.
"""

from __future__ import annotations

import asyncio
import datetime
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import aiodist.store as st
from aiodist.errors import DistError, DistStoreError, DistTimeoutError, DistTypeError, DistValueError
from aiodist.store import blocking

pytestmark = pytest.mark.timeout(20)

SECRET = b"store-test-secret"
KINDS = ["hash", "file", "tcp", "prefix-hash", "prefix-tcp"]
T = 0.3  # a short store timeout for the tests that wait in vain


@pytest.fixture(params=KINDS)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[st.Store]:
    kind: str = request.param
    owned: list[st.Store] = []
    s: st.Store
    if kind.endswith("hash"):
        s = st.HashStore(timeout=T)
        owned.append(s)
    elif kind == "file":
        s = st.FileStore(tmp_path / "store", timeout=T)
        owned.append(s)
    else:
        master = st.TCPStore("127.0.0.1", 0, is_master=True, timeout=T, secret=SECRET)
        await master.start()
        s = st.TCPStore("127.0.0.1", master.port, timeout=T, secret=SECRET)
        owned += [s, master]
    if kind.startswith("prefix"):
        s = st.PrefixStore("job1", s)
    try:
        yield s
    finally:
        for o in owned:
            await o.aclose()


# -- the operations ------------------------------------------------------------------------
async def test_set_get_bytes_and_str(store: st.Store) -> None:
    await store.set("a", b"\x00\xffbytes")
    await store.set("b", "text é")
    await store.set("c", bytearray(b"ba"))
    await store.set("empty", b"")
    assert await store.get("a") == b"\x00\xffbytes"
    assert await store.get("b") == "text é".encode()
    assert await store.get("c") == b"ba"
    assert await store.get("empty") == b""
    await store.set("a", b"overwritten")
    assert await store.get("a") == b"overwritten"


async def test_get_waits_for_a_later_set(store: st.Store) -> None:
    store.set_timeout(5.0)
    getter = asyncio.create_task(store.get("late"))
    await asyncio.sleep(0.05)
    assert not getter.done()
    await store.set("late", b"here")
    assert await asyncio.wait_for(getter, 2) == b"here"


async def test_get_times_out_naming_the_key(store: st.Store) -> None:
    t0 = time.monotonic()
    with pytest.raises(DistTimeoutError, match="missing-key") as info:
        await store.get("missing-key")
    elapsed = time.monotonic() - t0
    assert T * 0.9 <= elapsed <= T + 1.0
    assert isinstance(info.value, TimeoutError)


async def test_add(store: st.Store) -> None:
    assert await store.add("n", 5) == 5
    assert await store.add("n", -2) == 3
    assert await store.add("n", 0) == 3
    assert await store.get("n") == b"3"
    await store.set("m", "40")
    assert await store.add("m", 2) == 42
    await store.set("word", "abc")
    with pytest.raises(DistValueError, match="not an integer"):
        await store.add("word", 1)
    with pytest.raises(DistValueError, match="64-bit"):
        await store.add("n", 2**63 - 1)
    assert await store.get("n") == b"3"


async def test_compare_set_follows_torch(store: st.Store) -> None:
    # missing key, empty expectation: set
    assert await store.compare_set("k", b"", b"first") == b"first"
    # wrong expectation: unchanged, current value returned
    assert await store.compare_set("k", b"nope", b"second") == b"first"
    # right expectation: swapped
    assert await store.compare_set("k", "first", "second") == b"second"
    assert await store.get("k") == b"second"
    # missing key, non-empty expectation: not set, the expectation comes back
    assert await store.compare_set("other", b"exp", b"des") == b"exp"
    assert not await store.check(["other"])


async def test_wait_and_check(store: st.Store) -> None:
    await store.wait([])
    assert await store.check([])
    assert not await store.check(["w1"])
    waiter = asyncio.create_task(store.wait(["w1", "w2"], timeout=5.0))
    await store.set("w1", b"1")
    await asyncio.sleep(0.05)
    assert not waiter.done()
    await store.set("w2", b"2")
    await asyncio.wait_for(waiter, 2)
    assert await store.check(["w1", "w2"])
    assert not await store.check(["w1", "w3"])


async def test_wait_timeout_names_only_the_missing_keys(store: st.Store) -> None:
    await store.set("present", b"x")
    t0 = time.monotonic()
    with pytest.raises(DistTimeoutError) as info:
        await store.wait(["present", "absent1", "absent2"], timeout=datetime.timedelta(seconds=0.2))
    assert time.monotonic() - t0 < 1.5
    msg = str(info.value)
    assert "absent1" in msg and "absent2" in msg and "'present'" not in msg
    with pytest.raises(DistTimeoutError):
        await store.wait(["absent1"], timeout=0)


async def test_delete_key(store: st.Store) -> None:
    await store.set("d", b"1")
    assert await store.delete_key("d") is True
    assert await store.delete_key("d") is False
    assert not await store.check(["d"])
    with pytest.raises(DistTimeoutError):
        await store.get("d")
    await store.set("d", b"again")
    assert await store.get("d") == b"again"


async def test_num_keys(store: st.Store) -> None:
    assert await store.num_keys() == 0
    await store.set("a", b"1")
    await store.add("b", 1)
    await store.multi_set(["c", "d"], [b"", b""])
    assert await store.num_keys() == 4
    await store.delete_key("a")
    assert await store.num_keys() == 3


async def test_append(store: st.Store) -> None:
    await store.append("log", b"ab")
    await store.append("log", "cd")
    assert await store.get("log") == b"abcd"


async def test_multi_set_and_multi_get(store: st.Store) -> None:
    await store.multi_set(["x", "y", "z"], [b"1", "2", bytearray(b"3")])
    assert await store.multi_get(["z", "x", "y"]) == [b"3", b"1", b"2"]
    assert await store.multi_get([]) == []
    with pytest.raises(DistValueError, match="2 keys but 1 values"):
        await store.multi_set(["p", "q"], [b"1"])
    with pytest.raises(DistTimeoutError, match="nope'"):
        await store.multi_get(["x", "nope"])


async def test_multi_get_waits(store: st.Store) -> None:
    store.set_timeout(5)
    task = asyncio.create_task(store.multi_get(["m1", "m2"]))
    await store.set("m1", b"a")
    await asyncio.sleep(0.02)
    assert not task.done()
    await store.set("m2", b"b")
    assert await asyncio.wait_for(task, 2) == [b"a", b"b"]


async def test_timeout_property(store: st.Store) -> None:
    assert store.timeout == pytest.approx(T)
    store.set_timeout(datetime.timedelta(seconds=7))
    assert store.timeout == 7.0
    store.set_timeout(1)
    assert store.timeout == 1.0
    with pytest.raises(DistValueError):
        store.set_timeout(-1)
    with pytest.raises(DistTypeError):
        store.set_timeout("10")  # type: ignore[arg-type]


async def test_bad_arguments(store: st.Store) -> None:
    with pytest.raises(DistTypeError):
        await store.set(1, b"x")  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # DistTypeError is also a TypeError
        await store.set("k", 12)  # type: ignore[arg-type]
    with pytest.raises(DistTypeError):
        await store.get(b"k")  # type: ignore[arg-type]
    with pytest.raises(DistTypeError, match="list of str"):
        await store.wait("k")
    with pytest.raises(DistTypeError):
        await store.check([1])  # type: ignore[list-item]
    with pytest.raises(DistTypeError):
        await store.add("k", 1.5)  # type: ignore[arg-type]
    with pytest.raises(DistValueError):
        await store.wait(["k"], timeout=-1)
    with pytest.raises(DistTypeError):
        await store.compare_set("k", None, b"x")  # type: ignore[arg-type]
    assert await store.num_keys() == 0  # nothing of the above reached the store


async def test_many_concurrent_waiters(store: st.Store) -> None:
    store.set_timeout(10)
    getters = [asyncio.create_task(store.get(f"key{i}")) for i in range(100)]
    waiter = asyncio.create_task(store.wait([f"key{i}" for i in range(100)]))
    await asyncio.sleep(0.02)
    await store.multi_set([f"key{i}" for i in range(0, 100, 2)], [str(i) for i in range(0, 100, 2)])
    for i in range(1, 100, 2):
        await store.set(f"key{i}", str(i))
    results = await asyncio.wait_for(asyncio.gather(*getters), 5)
    assert results == [str(i).encode() for i in range(100)]
    await asyncio.wait_for(waiter, 5)


async def test_concurrent_adds_are_atomic(store: st.Store) -> None:
    results = await asyncio.gather(*(store.add("counter", 1) for _ in range(50)))
    assert sorted(results) == list(range(1, 51))
    assert await store.get("counter") == b"50"


async def test_cancelled_wait_leaves_the_store_usable(store: st.Store) -> None:
    store.set_timeout(10)
    task = asyncio.create_task(store.get("c"))
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await store.set("c", b"v")
    assert await store.get("c") == b"v"


# -- lifetimes -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["hash", "file", "tcp"])
@pytest.mark.parametrize("how", ["aclose", "abort"])
async def test_closing_fails_pending_and_later_calls(kind: str, how: str, tmp_path: Path) -> None:
    master: st.TCPStore | None = None
    s: st.Store
    if kind == "hash":
        s = st.HashStore(timeout=10)
    elif kind == "file":
        s = st.FileStore(tmp_path / "f", timeout=10)
    else:
        master = st.TCPStore("127.0.0.1", 0, is_master=True, secret=SECRET)
        await master.start()
        s = st.TCPStore("127.0.0.1", master.port, timeout=10, secret=SECRET)
    await s.set("k", b"v")
    pending = asyncio.create_task(s.get("never"))
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    if how == "aclose":
        await s.aclose()
    else:
        s.abort()
    with pytest.raises(DistStoreError):
        await asyncio.wait_for(pending, 2)
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(DistStoreError):
        await s.get("k")
    await s.aclose()  # idempotent
    s.abort()
    if master is not None:
        await master.aclose()


async def test_async_context_manager(tmp_path: Path) -> None:
    async with st.HashStore() as h:
        await h.set("k", b"v")
    with pytest.raises(DistStoreError):
        await h.get("k")
    async with st.TCPStore("127.0.0.1", 0, is_master=True, secret=SECRET) as m:
        assert m.port != 0
        assert await m.add("k", 1) == 1
    async with st.FileStore(tmp_path / "f", world_size=1) as f:
        await f.set("k", b"v")
    assert not (tmp_path / "f").exists()


# -- PrefixStore -----------------------------------------------------------------------------
async def test_prefix_stores_are_isolated() -> None:
    base = st.HashStore(timeout=0.2)
    a, b = st.PrefixStore("a", base), st.PrefixStore("b", base)
    await a.set("k", b"from a")
    await b.set("k", b"from b")
    assert await a.get("k") == b"from a"
    assert await b.get("k") == b"from b"
    assert await base.get("a/k") == b"from a"
    assert await a.add("n", 1) == 1
    assert await b.add("n", 5) == 5
    assert not await b.check(["only-a"])
    await a.set("only-a", b"")
    assert not await b.check(["only-a"])
    assert await base.check(["a/only-a"])
    nested = st.PrefixStore("inner", a)
    await nested.set("x", b"1")
    assert await base.get("a/inner/x") == b"1"
    assert await a.delete_key("k")
    assert await b.get("k") == b"from b"
    assert a.underlying_store is base and a.prefix == "a"
    a.set_timeout(3)
    assert base.timeout == 3
    await a.aclose()  # does not own the base store
    assert await base.get("b/k") == b"from b"
    with pytest.raises(DistTypeError):
        st.PrefixStore(3, base)  # type: ignore[arg-type]
    with pytest.raises(DistTypeError):
        st.PrefixStore("p", object())  # type: ignore[arg-type]


def test_errors_are_dist_errors() -> None:
    for cls in (DistStoreError, DistTimeoutError, DistTypeError, DistValueError):
        assert issubclass(cls, DistError)


def test_public_names() -> None:
    assert sorted(st.__all__) == ["FileStore", "HashStore", "PrefixStore", "Store", "StoreServer", "TCPStore"]
    assert sorted(blocking.__all__) == ["BlockingStore", "FileStore", "HashStore", "PrefixStore", "TCPStore"]


# -- the blocking face ---------------------------------------------------------------------
BLOCKING_KINDS = ["hash", "file", "tcp", "prefix-tcp", "prefix-file"]


@pytest.fixture(params=BLOCKING_KINDS)
def bstore(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[blocking.BlockingStore]:
    kind: str = request.param
    owned: list[blocking.BlockingStore] = []
    s: blocking.BlockingStore
    if kind == "hash":
        s = blocking.HashStore(timeout=T)
        owned.append(s)
    elif kind.endswith("file"):
        s = blocking.FileStore(str(tmp_path / "bstore"), timeout=T)
        owned.append(s)
    else:
        master = blocking.TCPStore("127.0.0.1", 0, is_master=True, timeout=T, secret=SECRET)
        s = blocking.TCPStore("127.0.0.1", master.port, timeout=datetime.timedelta(seconds=T), secret=SECRET)
        owned += [s, master]
    if kind.startswith("prefix"):
        s = blocking.PrefixStore("pre", s)
    try:
        yield s
    finally:
        for o in owned:
            o.close()


def test_blocking_every_method(bstore: blocking.BlockingStore) -> None:
    s = bstore
    assert s.timeout == datetime.timedelta(seconds=T)
    s.set("a", b"1")
    s.set("b", "two")
    assert s.get("a") == b"1" and s.get("b") == b"two"
    assert s.add("n", 3) == 3 and s.add("n", 4) == 7
    assert s.compare_set("c", "", "x") == b"x"
    assert s.compare_set("c", "y", "z") == b"x"
    assert s.compare_set("c", "x", "z") == b"z"
    s.wait(["a", "b"])
    s.wait(["a"], datetime.timedelta(seconds=1))
    assert s.check(["a", "n"]) and not s.check(["zz"])
    s.append("log", "ab")
    s.append("log", b"c")
    assert s.get("log") == b"abc"
    s.multi_set(["m1", "m2"], ["x", b"y"])
    assert s.multi_get(["m2", "m1"]) == [b"y", b"x"]
    assert s.num_keys() == 7
    assert s.delete_key("a") is True and s.delete_key("a") is False
    assert s.num_keys() == 6
    with pytest.raises(DistTimeoutError, match="gone'"):
        s.get("gone")
    with pytest.raises(DistTimeoutError, match="w'"):
        s.wait(["w", "b"], 0.1)
    with pytest.raises(DistTypeError):
        s.set(5, b"x")  # type: ignore[arg-type]
    s.set_timeout(datetime.timedelta(seconds=2))
    assert s.timeout.total_seconds() == 2


def test_blocking_get_from_another_thread(bstore: blocking.BlockingStore) -> None:
    bstore.set_timeout(5)
    results: list[bytes] = []
    reader = threading.Thread(target=lambda: results.append(bstore.get("from-thread")))
    reader.start()
    time.sleep(0.05)
    bstore.set("from-thread", b"hello")
    reader.join(3)
    assert results == [b"hello"]


def test_blocking_wraps_async_store() -> None:
    with blocking.HashStore() as h:
        assert isinstance(h.async_store, st.HashStore)
        p = blocking.PrefixStore("p", h)
        p.set("k", b"v")
        assert h.get("p/k") == b"v"
        assert isinstance(p.async_store, st.PrefixStore)
        assert p.underlying_store is h
    with pytest.raises(DistStoreError):
        h.get("p/k")
    with pytest.raises(DistTypeError):
        blocking.BlockingStore(object())  # type: ignore[arg-type]


def test_blocking_tcp_master_properties() -> None:
    master = blocking.TCPStore("localhost", 0, world_size=2, is_master=True, timeout=5, secret=SECRET)
    try:
        assert master.port > 0 and master.host == "localhost"
        client = blocking.TCPStore("localhost", master.port, world_size=2, timeout=5, secret=SECRET)
        client.set("k", b"v")
        assert master.get("k") == b"v"
        client.abort()
        with pytest.raises(DistStoreError):
            client.get("k")
    finally:
        master.close()
