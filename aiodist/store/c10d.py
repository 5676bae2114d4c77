"""aiodist's async ``Store`` interface over a torch ``c10d.Store``.

Two users: torch hands the "aiodist" backend the store its init method built (TCPStore,
FileStore, HashStore, a user's store, under a per-group prefix), so whatever torch's
``init_process_group`` accepted also connects aiodist's peers; and under torchrun, both faces'
``env://`` rendezvous joins the TCPStore torchrun's agent hosts (``aiodist.rendezvous.torchelastic``).
torch's store calls block (releasing the GIL); each runs in a worker thread so the runtime loop
keeps running meanwhile. Nothing here imports torch: the store is an object torch made.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from aiodist.errors import DistStoreError, DistTimeoutError
from aiodist.store.base import Store, Timeout, Value, as_bytes, as_seconds, validate_key, validate_keys

__all__ = ["TorchStore", "first_line"]

T = TypeVar("T")

# ``wait`` checks again after these pauses (doubling): a key set by a peer that is a moment
# behind is seen within a millisecond or two; one set much later costs a check per 50 ms.
_FIRST_PAUSE = 0.001
_MAX_PAUSE = 0.05


def first_line(exc: BaseException) -> str:
    """What torch's exception says, without the C++ stack torch appends to some messages."""
    text = str(exc).strip()
    return text.split("\n", 1)[0].split(" Exception raised from ", 1)[0] or type(exc).__name__


class TorchStore(Store):
    """Adapt the torch store ``store`` (blocking) to aiodist's async ``Store``."""

    def __init__(self, store: Any, timeout: float) -> None:
        self._store = store
        self._timeout = timeout

    async def _run(self, what: str, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(None, fn)
        except Exception as exc:
            if isinstance(exc, DistTimeoutError | DistStoreError):
                raise
            text = first_line(exc)
            if "timeout" in text.lower() or "timed out" in text.lower():
                raise DistTimeoutError(f"torch store {what}: {text}") from exc
            raise DistStoreError(f"torch store {what} failed: {text}") from exc

    async def aclose(self) -> None:
        """The store belongs to torch: nothing to release."""

    def abort(self) -> None:
        """The store belongs to torch: nothing to release."""

    @property
    def timeout(self) -> float:
        return self._timeout

    def set_timeout(self, timeout: Timeout) -> None:
        """The timeout of later calls, here and in torch's store (its ``get`` waits that long)."""
        self._timeout = as_seconds(timeout)
        self._store.set_timeout(datetime.timedelta(seconds=self._timeout))

    async def set(self, key: str, value: Value) -> None:
        data = as_bytes(value)
        await self._run("set", functools.partial(self._store.set, validate_key(key), data))

    async def get(self, key: str) -> bytes:
        return bytes(await self._run("get", functools.partial(self._store.get, validate_key(key))))

    async def add(self, key: str, amount: int) -> int:
        return int(await self._run("add", functools.partial(self._store.add, validate_key(key), amount)))

    async def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        fn = functools.partial(
            self._store.compare_set, validate_key(key), as_bytes(expected), as_bytes(desired)
        )
        return bytes(await self._run("compare_set", fn))

    async def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        """Wait until every key of ``keys`` is set, polling torch's non-blocking ``check``.

        Not torch's ``wait``: the rendezvous waits in slices (to notice an error another rank
        published meanwhile), and torch's TCPStore client logs two warnings ("waitForInput ...
        timed out after 200ms") for every ``wait`` that times out, which a slow peer turned
        into a stream of spurious warnings on successful runs. A ``check`` never times out; no
        worker thread stays blocked between checks either.
        """
        names = validate_keys(keys)
        seconds = self._timeout if timeout is None else as_seconds(timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        pause = _FIRST_PAUSE
        while not await self._run("check", functools.partial(self._store.check, names)):
            left = deadline - loop.time()
            if left <= 0:
                raise DistTimeoutError(f"torch store wait: keys {names} were not set within {seconds:g} s")
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, _MAX_PAUSE)

    async def check(self, keys: Sequence[str]) -> bool:
        return bool(await self._run("check", functools.partial(self._store.check, validate_keys(keys))))

    async def delete_key(self, key: str) -> bool:
        return bool(
            await self._run("delete_key", functools.partial(self._store.delete_key, validate_key(key)))
        )

    async def num_keys(self) -> int:
        return int(await self._run("num_keys", self._store.num_keys))

    async def append(self, key: str, value: Value) -> None:
        fn = functools.partial(self._store.append, validate_key(key), as_bytes(value))
        await self._run("append", fn)

    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        values = await self._run("multi_get", functools.partial(self._store.multi_get, validate_keys(keys)))
        return [bytes(v) for v in values]

    async def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        data = [as_bytes(v) for v in values]
        await self._run("multi_set", functools.partial(self._store.multi_set, validate_keys(keys), data))
