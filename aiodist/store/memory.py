"""In-memory keys with asyncio waiters: ``KeyTable`` (the engine) and ``HashStore`` (the store).

``KeyTable`` is shared by ``HashStore`` and the TCP store server, so both answer every
operation the same way. It belongs to one event loop and is not thread-safe.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence

from aiodist.errors import DistStoreError, DistValueError
from aiodist.store.base import (
    DEFAULT_TIMEOUT,
    INT64_MAX,
    INT64_MIN,
    Store,
    Timeout,
    Value,
    as_bytes,
    as_seconds,
    check_amount,
    check_multi_set,
    keys_timeout_error,
    parse_counter,
    validate_key,
    validate_keys,
)

__all__ = ["HashStore", "KeyTable"]


class KeyTable:
    """Keys, values, and the futures of those waiting for keys to appear.

    Every mutation that makes a key present wakes that key's waiters; a woken waiter re-checks
    all of its keys, so a key deleted again before the waiter runs is simply waited for again.
    """

    __slots__ = ("_data", "_waiters")

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._waiters: dict[str, set[asyncio.Future[None]]] = {}

    # -- reads ----------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        return self._data.get(key)

    def values(self, keys: Sequence[str]) -> list[bytes]:
        """Values of keys known to be present (``KeyError`` otherwise: a bug of the caller)."""
        return [self._data[k] for k in keys]

    def missing(self, keys: Sequence[str]) -> list[str]:
        return [k for k in keys if k not in self._data]

    def check(self, keys: Sequence[str]) -> bool:
        return all(k in self._data for k in keys)

    def num_keys(self) -> int:
        return len(self._data)

    # -- writes ---------------------------------------------------------------------------
    def set(self, key: str, value: bytes) -> None:
        self._data[key] = value
        self._wake(key)

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        for k, v in zip(keys, values, strict=True):
            self._data[k] = v
        for k in keys:
            self._wake(k)

    def add(self, key: str, amount: int) -> int:
        old = self._data.get(key)
        new = (0 if old is None else parse_counter(key, old)) + amount
        if not INT64_MIN <= new <= INT64_MAX:
            raise DistValueError(f"add({key!r}, {amount}) would leave the 64-bit range")
        self.set(key, str(new).encode())
        return new

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        current = self._data.get(key)
        if (current is None and not expected) or (current is not None and current == expected):
            self.set(key, desired)
            return desired
        # torch's answer for a missing key with a non-empty expectation is the expectation itself.
        return expected if current is None else current

    def append(self, key: str, value: bytes) -> None:
        self.set(key, self._data.get(key, b"") + value)

    def delete(self, key: str) -> bool:
        return self._data.pop(key, None) is not None

    # -- waiting --------------------------------------------------------------------------
    async def wait(self, keys: Sequence[str], timeout: float) -> list[str]:
        """Wait until every key is present or ``timeout`` seconds (``inf``: no limit) pass.

        Returns:
            ``[]`` when all keys are present, else the keys still missing at the timeout.
        Raises:
            whatever ``fail_waiters`` puts into the waiters (the table's owner closed it).
        """
        missing = self.missing(keys)
        if not missing or timeout <= 0:
            return missing
        loop = asyncio.get_running_loop()
        deadline = None if math.isinf(timeout) else loop.time() + timeout
        while missing:
            fut: asyncio.Future[None] = loop.create_future()
            for k in missing:
                self._waiters.setdefault(k, set()).add(fut)
            try:
                async with asyncio.timeout_at(deadline):
                    await fut
            except TimeoutError:
                return self.missing(keys)
            finally:
                self._forget(fut, missing)
            missing = self.missing(keys)
        return []

    def fail_waiters(self, make_error: Callable[[], BaseException]) -> None:
        """Raise ``make_error()`` in every pending ``wait`` (the table is being closed)."""
        waiters = {f for group in self._waiters.values() for f in group}
        self._waiters.clear()
        for fut in waiters:
            if not fut.done():
                fut.set_exception(make_error())

    def _wake(self, key: str) -> None:
        group = self._waiters.pop(key, None)
        if group:
            for fut in group:
                if not fut.done():
                    fut.set_result(None)

    def _forget(self, fut: asyncio.Future[None], keys: Sequence[str]) -> None:
        for k in keys:
            group = self._waiters.get(k)
            if group is not None:
                group.discard(fut)
                if not group:
                    del self._waiters[k]


class HashStore(Store):
    """A store held in this process's memory, for tasks of one event loop (tests, one-process jobs).

    Args:
        timeout: default timeout of ``get``/``wait``/``multi_get`` (seconds or ``timedelta``).
    """

    def __init__(self, *, timeout: Timeout = DEFAULT_TIMEOUT) -> None:
        self._table = KeyTable()
        self._timeout = as_seconds(timeout)
        self._closed = False

    def __repr__(self) -> str:
        return f"HashStore(num_keys={self._table.num_keys()}, closed={self._closed})"

    # -- lifetime ------------------------------------------------------------------------
    async def aclose(self) -> None:
        self.abort()

    def abort(self) -> None:
        if not self._closed:
            self._closed = True
            self._table.fail_waiters(lambda: DistStoreError("HashStore was closed while a call waited on it"))

    def _check_open(self) -> None:
        if self._closed:
            raise DistStoreError("HashStore is closed")

    # -- timeout -------------------------------------------------------------------------
    @property
    def timeout(self) -> float:
        return self._timeout

    def set_timeout(self, timeout: Timeout) -> None:
        self._timeout = as_seconds(timeout)

    # -- operations ----------------------------------------------------------------------
    async def set(self, key: str, value: Value) -> None:
        key, data = validate_key(key), as_bytes(value)
        self._check_open()
        self._table.set(key, data)

    async def get(self, key: str) -> bytes:
        key = validate_key(key)
        await self._wait("get", [key], self._timeout)
        return self._table.values([key])[0]

    async def add(self, key: str, amount: int) -> int:
        key, amount = validate_key(key), check_amount(amount)
        self._check_open()
        return self._table.add(key, amount)

    async def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        key = validate_key(key)
        exp, des = as_bytes(expected, "expected"), as_bytes(desired, "desired")
        self._check_open()
        return self._table.compare_set(key, exp, des)

    async def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        key_list = validate_keys(keys)
        await self._wait("wait", key_list, self._timeout if timeout is None else as_seconds(timeout))

    async def check(self, keys: Sequence[str]) -> bool:
        key_list = validate_keys(keys)
        self._check_open()
        return self._table.check(key_list)

    async def delete_key(self, key: str) -> bool:
        key = validate_key(key)
        self._check_open()
        return self._table.delete(key)

    async def num_keys(self) -> int:
        self._check_open()
        return self._table.num_keys()

    async def append(self, key: str, value: Value) -> None:
        key, data = validate_key(key), as_bytes(value)
        self._check_open()
        self._table.append(key, data)

    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        key_list = validate_keys(keys)
        await self._wait("multi_get", key_list, self._timeout)
        return self._table.values(key_list)

    async def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        key_list, data = check_multi_set(keys, values)
        self._check_open()
        self._table.multi_set(key_list, data)

    async def _wait(self, op: str, keys: list[str], timeout: float) -> None:
        self._check_open()
        missing = await self._table.wait(keys, timeout)
        if missing:
            raise keys_timeout_error(op, missing, timeout, "HashStore")
