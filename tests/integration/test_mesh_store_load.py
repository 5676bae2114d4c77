"""Joining asks the store a number of times per rank that does not grow with the world size.

The store is one process's loop (rank 0's, usually, which connects its own peers on it): asking
it once per peer per rank made 64 ranks on one host time out at init, ranks starving in the
store's accept queue while the others polled it.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence

import pytest

from aiodist.settings import Settings
from aiodist.store import PrefixStore, Store
from aiodist.store.base import Timeout, Value
from aiodist.store.memory import HashStore
from aiodist.transport.mesh import claim_rank, connect_mesh
from aiodist.transport.shm_tcp import ShmTcpTransport

pytestmark = pytest.mark.timeout(60)


class CountingStore(PrefixStore):
    """A view of a shared store that counts the requests one rank makes, by what they name."""

    def __init__(self, store: Store) -> None:
        super().__init__("job", store)
        self.requests: Counter[str] = Counter()

    def _note(self, keys: Sequence[str]) -> None:
        self.requests["all"] += 1
        if any(k.startswith("addr/") for k in keys):
            self.requests["addresses"] += 1
        if "roster" in keys:
            self.requests["roster"] += 1

    async def set(self, key: str, value: Value) -> None:
        self._note([key])
        await super().set(key, value)

    async def get(self, key: str) -> bytes:
        self._note([key])
        return await super().get(key)

    async def add(self, key: str, amount: int) -> int:
        self._note([key])
        return await super().add(key, amount)

    async def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        self._note([key])
        return await super().compare_set(key, expected, desired)

    async def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        self._note(keys)
        await super().wait(keys, timeout)

    async def check(self, keys: Sequence[str]) -> bool:
        self._note(keys)
        return await super().check(keys)

    async def append(self, key: str, value: Value) -> None:
        self._note([key])
        await super().append(key, value)

    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        self._note(keys)
        return await super().multi_get(keys)


async def _join_all(world_size: int) -> list[Counter[str]]:
    shared = HashStore()
    settings = Settings.read({"AIODIST_SHM": "0"})
    views = [CountingStore(shared) for _ in range(world_size)]

    async def join(rank: int) -> ShmTcpTransport:
        me = await claim_rank(views[rank], rank, world_size, settings)
        return await connect_mesh(
            views[rank],
            me,
            world_size,
            group_name="load",
            secret=None,
            host="127.0.0.1",
            timeout=30,
            settings=settings,
        )

    transports = await asyncio.gather(*(join(r) for r in range(world_size)))
    for t in transports:
        t.abort()
    return [v.requests for v in views]


async def test_rank_0_reads_every_address_at_once_and_the_others_read_its_roster() -> None:
    requests = await _join_all(12)
    # Rank 0: its own address published, one wait and one read for all the others' (and a wait
    # again for each 0.2 s that one of them is late); the roster published, then read back.
    assert 3 <= requests[0]["addresses"] <= 8, requests[0]
    # Every other rank publishes its address and reads nobody's: rank 0's roster names them all,
    # in one wait and one read (again, a wait more for each 0.2 s that rank 0 is late).
    assert all(r["addresses"] == 1 for r in requests[1:]), requests
    assert all(2 <= r["roster"] <= 8 for r in requests), requests


async def test_a_larger_world_asks_the_store_no_more_per_rank() -> None:
    small = max(r["all"] for r in await _join_all(3))
    large = max(r["all"] for r in await _join_all(12))
    # (While a rank waits, it looks for a failure reported elsewhere every 0.2 s: a few more
    # requests where the larger job takes longer to connect on a loaded machine.)
    assert large <= small + 12, (small, large)
