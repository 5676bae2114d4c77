"""Blocking stores for the sync face: torch's store classes, each wrapping an async store.

Every method runs the async store's coroutine on the process-wide loop thread
(``aiodist.runtime.loop_thread``) and blocks the calling thread for the result, so these objects can
be used from any thread except that loop thread itself. Constructors connect (or open the
file) at once, as torch's do. ``.async_store`` is the wrapped async store, for code that mixes
both faces. ``timeout`` is a ``datetime.timedelta`` here, as in torch.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Coroutine, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

from aiodist.errors import DistTypeError
from aiodist.runtime.loop_thread import get_loop_thread
from aiodist.store import client as _client
from aiodist.store import file as _file
from aiodist.store import memory as _memory
from aiodist.store import prefix as _prefix
from aiodist.store.base import DEFAULT_TIMEOUT, Store, Timeout, Value

__all__ = ["BlockingStore", "FileStore", "HashStore", "PrefixStore", "TCPStore"]

T = TypeVar("T")


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return get_loop_thread().run(coro)


class StoreCalls:
    """The store's operations as blocking calls on ``self._store``, each run through ``_call``.

    Shared by the sync face's stores (below) and the store torch's engines see
    (``aiodist.backends.torch_engine``); see ``aiodist.store.Store`` for the contracts.
    """

    _store: Store

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        raise NotImplementedError

    def set(self, key: str, value: Value) -> None:
        self._call(self._store.set(key, value))

    def get(self, key: str) -> bytes:
        return bytes(self._call(self._store.get(key)))

    def add(self, key: str, amount: int) -> int:
        return int(self._call(self._store.add(key, amount)))

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        return bytes(self._call(self._store.compare_set(key, expected, desired)))

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        self._call(self._store.wait(list(keys), timeout))

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._call(self._store.check(list(keys))))

    def delete_key(self, key: str) -> bool:
        return bool(self._call(self._store.delete_key(key)))

    def num_keys(self) -> int:
        return int(self._call(self._store.num_keys()))

    def append(self, key: str, value: Value) -> None:
        self._call(self._store.append(key, value))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return [bytes(v) for v in self._call(self._store.multi_get(list(keys)))]

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        self._call(self._store.multi_set(list(keys), list(values)))


class BlockingStore(StoreCalls):
    """A blocking face over an async ``Store`` on the loop thread; the base of the torch-named classes below."""

    def __init__(self, store: Store) -> None:
        if not isinstance(store, Store):
            raise DistTypeError(f"store must be an aiodist Store, not {type(store).__name__}")
        self._store = store

    def __repr__(self) -> str:
        return f"{type(self).__name__}[blocking]({self._store!r})"

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return _run(coro)

    @property
    def async_store(self) -> Store:
        """The async store this object drives (it lives on the loop thread)."""
        return self._store

    # -- lifetime ------------------------------------------------------------------------
    def close(self) -> None:
        """Close the store gracefully (``aclose``)."""
        _run(self._store.aclose())

    def abort(self) -> None:
        """Close the store at once."""
        _run(_abort(self._store))

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- timeout -------------------------------------------------------------------------
    @property
    def timeout(self) -> datetime.timedelta:
        """The default timeout of waiting calls (a ``timedelta``, as torch's ``Store.timeout``)."""
        return datetime.timedelta(seconds=self._store.timeout)

    def set_timeout(self, timeout: Timeout) -> None:
        self._store.set_timeout(timeout)


async def _abort(store: Store) -> None:
    store.abort()


class TCPStore(BlockingStore):
    """Blocking ``TCPStore``: the constructor starts the server (master) and connects.

    Same arguments as ``aiodist.store.TCPStore``; ``wait_for_workers`` and ``use_libuv`` are
    accepted for torch compatibility and ignored. Close it explicitly (``close()`` or ``with``):
    dropping this wrapper does not stop the connection or a master's server, because the
    wrapped ``async_store`` may live on (``init_process_group(store=TCPStore(...))``).

    Raises:
        DistStoreError: the server could not be started, reached or authenticated with.
    """

    _store: _client.TCPStore

    def __init__(
        self,
        host: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: Timeout = DEFAULT_TIMEOUT,
        wait_for_workers: bool = True,
        *,
        sock: socket.socket | None = None,
        secret: bytes | None = None,
        handshake_timeout: float = 10.0,
        use_libuv: bool = True,
    ) -> None:
        store = _client.TCPStore(
            host,
            port,
            world_size,
            is_master,
            timeout,
            sock=sock,
            secret=secret,
            handshake_timeout=handshake_timeout,
        )
        super().__init__(store)
        _run(store.start())

    @property
    def host(self) -> str:
        return self._store.host

    @property
    def port(self) -> int:
        return self._store.port


class FileStore(BlockingStore):
    """Blocking ``FileStore``: the constructor opens the file and registers this store."""

    _store: _file.FileStore

    def __init__(
        self,
        file_name: str | os.PathLike[str],
        world_size: int | None = None,
        *,
        timeout: Timeout = DEFAULT_TIMEOUT,
    ) -> None:
        store = _file.FileStore(file_name, world_size, timeout=timeout)
        super().__init__(store)
        _run(store.start())

    @property
    def path(self) -> str:
        return self._store.path


class HashStore(BlockingStore):
    """Blocking ``HashStore``: an in-memory store shared by the threads of this process."""

    def __init__(self, *, timeout: Timeout = DEFAULT_TIMEOUT) -> None:
        super().__init__(_memory.HashStore(timeout=timeout))


class PrefixStore(BlockingStore):
    """Blocking ``PrefixStore`` over a blocking store (or an async one living on the loop thread)."""

    _store: _prefix.PrefixStore

    def __init__(self, prefix: str, store: BlockingStore | Store) -> None:
        inner = store.async_store if isinstance(store, BlockingStore) else store
        super().__init__(_prefix.PrefixStore(prefix, inner))
        self._underlying = store

    @property
    def underlying_store(self) -> BlockingStore | Store:
        return self._underlying
