"""``PrefixStore``: a view of another store in which every key is ``prefix/key``."""

from __future__ import annotations

from collections.abc import Sequence

from aiodist.errors import DistTypeError
from aiodist.store.base import Store, Timeout, Value, validate_key, validate_keys

__all__ = ["PrefixStore"]


class PrefixStore(Store):
    """Prefix every key with ``prefix + "/"`` before handing it to ``store``.

    Several jobs or groups can then share one store without meeting each other's keys.
    The prefix store does not own ``store``: ``aclose``/``abort`` leave it open, and
    ``num_keys`` and the timeout are those of the underlying store (as in torch).

    Args:
        prefix: the namespace (a str).
        store: the underlying async store.

    Raises:
        DistTypeError: ``prefix`` is not a str or ``store`` not a ``Store``.
    """

    def __init__(self, prefix: str, store: Store) -> None:
        self._prefix = validate_key(prefix, "prefix")
        if not isinstance(store, Store):
            raise DistTypeError(f"store must be an aiodist Store, not {type(store).__name__}")
        self._store = store

    def __repr__(self) -> str:
        return f"PrefixStore({self._prefix!r}, {self._store!r})"

    @property
    def prefix(self) -> str:
        return self._prefix

    @property
    def underlying_store(self) -> Store:
        return self._store

    def _k(self, key: str) -> str:
        return f"{self._prefix}/{validate_key(key)}"

    def _ks(self, keys: Sequence[str]) -> list[str]:
        return [f"{self._prefix}/{k}" for k in validate_keys(keys)]

    # -- lifetime ------------------------------------------------------------------------
    async def start(self) -> None:
        await self._store.start()

    async def aclose(self) -> None:
        """Nothing to release: the underlying store belongs to whoever created it."""

    def abort(self) -> None:
        """Nothing to release: the underlying store belongs to whoever created it."""

    # -- timeout -------------------------------------------------------------------------
    @property
    def timeout(self) -> float:
        return self._store.timeout

    def set_timeout(self, timeout: Timeout) -> None:
        self._store.set_timeout(timeout)

    # -- operations ----------------------------------------------------------------------
    async def set(self, key: str, value: Value) -> None:
        await self._store.set(self._k(key), value)

    async def get(self, key: str) -> bytes:
        return await self._store.get(self._k(key))

    async def add(self, key: str, amount: int) -> int:
        return await self._store.add(self._k(key), amount)

    async def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        return await self._store.compare_set(self._k(key), expected, desired)

    async def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        await self._store.wait(self._ks(keys), timeout)

    async def check(self, keys: Sequence[str]) -> bool:
        return await self._store.check(self._ks(keys))

    async def delete_key(self, key: str) -> bool:
        return await self._store.delete_key(self._k(key))

    async def num_keys(self) -> int:
        return await self._store.num_keys()

    async def append(self, key: str, value: Value) -> None:
        await self._store.append(self._k(key), value)

    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return await self._store.multi_get(self._ks(keys))

    async def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        await self._store.multi_set(self._ks(keys), values)
