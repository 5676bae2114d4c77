"""``FileStore``: a store in a file shared by processes of one host (or a shared filesystem).

The file is a magic line followed by append-only records ``op | key length | value length |
key | value`` (op ``S`` sets, ``D`` deletes). Each process replays the records it has not seen
into a local dict. Every mutation runs under an exclusive ``fcntl.flock`` of the whole file and
appends with one ``write``; readers take a shared lock. ``get``/``wait`` poll the file size
with short async sleeps, so the event loop never blocks on another process.

Cleanup follows torch: with ``world_size``, each store counts itself in the file when it
opens and again when it closes, and the last of ``world_size`` to close deletes the file.
Without ``world_size`` the file is left in place.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import struct
from collections.abc import AsyncIterator, Sequence

from aiodist.errors import DistStoreError, DistTypeError, DistValueError
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

__all__ = ["FileStore"]

_MAGIC = b"aiodist-filestore 1\n"
_RECORD = struct.Struct("!cIQ")
_SET, _DEL = b"S", b"D"
# Bookkeeping keys live in the same file; the NUL prefix keeps them out of num_keys.
_INTERNAL = "\x00aiodist/"
_OPENED = _INTERNAL + "opened"
_CLOSED = _INTERNAL + "closed"
_FIRST_POLL = 0.001
_MAX_POLL = 0.05


class FileStore(Store):
    """A store shared through a file, locked with ``fcntl.flock`` per operation.

    Args:
        path: the file (created when missing).
        world_size: number of stores that will use the file; the last one to close deletes it.
            ``None``: never delete.
        timeout: default timeout of ``get``/``wait``/``multi_get`` (seconds or ``timedelta``).

    Raises:
        DistTypeError, DistValueError: bad arguments.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        world_size: int | None = None,
        *,
        timeout: Timeout = DEFAULT_TIMEOUT,
    ) -> None:
        if not isinstance(path, str | os.PathLike):
            raise DistTypeError(f"path must be a str or path, not {type(path).__name__}")
        if world_size is not None and (
            not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1
        ):
            raise DistValueError(f"world_size must be None or a positive int, got {world_size!r}")
        self._path = os.fspath(path)
        self.world_size = world_size
        self._timeout = as_seconds(timeout)
        self._fd: int | None = None
        self._offset = 0  # bytes of the file replayed into _data
        self._data: dict[str, bytes] = {}
        self._start_lock = asyncio.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"FileStore({self._path!r}, world_size={self.world_size})"

    @property
    def path(self) -> str:
        return self._path

    # -- timeout -------------------------------------------------------------------------
    @property
    def timeout(self) -> float:
        return self._timeout

    def set_timeout(self, timeout: Timeout) -> None:
        self._timeout = as_seconds(timeout)

    # -- lifetime ------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the file and count this store among its users.

        Raises:
            DistStoreError: the file cannot be opened, is not a FileStore file, or (with
                ``world_size``) more stores opened it than ``world_size`` (a stale file).
        """
        if self._fd is not None:
            return
        async with self._start_lock:
            if self._closed:
                raise DistStoreError(f"the FileStore on {self._path} is closed")
            if self._fd is not None:
                return
            try:
                fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                raise DistStoreError(f"could not open the FileStore file {self._path}: {exc}") from exc
            self._fd = fd
            try:
                async with self._flock(exclusive=True):
                    if os.fstat(fd).st_size == 0:
                        self._write(_MAGIC)
                    self._refresh()
                    opened = self._add_locked(_OPENED, 1)
            except BaseException:
                self._fd = None
                os.close(fd)
                raise
            if self.world_size is not None and opened > self.world_size:
                self.abort()
                raise DistStoreError(
                    f"{opened} stores have opened {self._path}, more than world_size={self.world_size}; "
                    "is it left over from an earlier job?"
                )

    async def aclose(self) -> None:
        """Count this store as done; the last of ``world_size`` deletes the file."""
        if self._fd is None:
            self._closed = True
            return
        try:
            if self.world_size is not None:
                async with self._flock(exclusive=True):
                    self._finish_locked()
        finally:
            self.abort()

    def abort(self) -> None:
        """Close the file without counting this store as done (the file stays)."""
        self._closed = True
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def close_blocking(self) -> None:
        """``aclose`` without an event loop (may block briefly on the file lock)."""
        fd = self._fd
        if fd is None:
            self._closed = True
            return
        try:
            if self.world_size is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
                self._finish_locked()
        finally:
            self.abort()

    def __del__(self) -> None:
        # Like torch, a store dropped without closing still takes part in the cleanup count.
        with contextlib.suppress(Exception):
            if self._fd is not None:
                self.close_blocking()

    def _finish_locked(self) -> None:
        self._refresh()
        if self._add_locked(_CLOSED, 1) >= (self.world_size or 0):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)

    # -- file primitives -----------------------------------------------------------------
    def _fileno(self) -> int:
        if self._fd is None:
            raise DistStoreError(f"the FileStore on {self._path} is closed")
        return self._fd

    @contextlib.asynccontextmanager
    async def _flock(self, exclusive: bool) -> AsyncIterator[None]:
        """Hold the file lock; wait for it with async sleeps rather than blocking the loop."""
        fd = self._fileno()
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        delay = _FIRST_POLL
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(delay)
                delay = min(delay * 2, _MAX_POLL)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self._fileno(), view)
            view = view[n:]

    def _append(self, records: Sequence[tuple[bytes, str, bytes]]) -> None:
        """Append records in one write (under the exclusive lock) and replay them."""
        parts = []
        for op, key, value in records:
            k = key.encode()
            parts += [_RECORD.pack(op, len(k), len(value)), k, value]
        self._write(b"".join(parts))
        self._refresh()

    def _refresh(self) -> None:
        """Replay the records other stores appended since we last looked."""
        fd = self._fileno()
        size = os.fstat(fd).st_size
        if size < self._offset:
            raise DistStoreError(f"the FileStore file {self._path} shrank: was it replaced while in use?")
        if size == self._offset:
            return
        data = os.pread(fd, size - self._offset, self._offset)
        pos = 0
        if self._offset == 0:
            if not data.startswith(_MAGIC):
                if len(data) < len(_MAGIC) and _MAGIC.startswith(data):
                    return  # the magic is being written
                raise DistStoreError(f"{self._path} is not a FileStore file")
            pos = len(_MAGIC)
        while len(data) - pos >= _RECORD.size:
            op, klen, vlen = _RECORD.unpack_from(data, pos)
            end = pos + _RECORD.size + klen + vlen
            if end > len(data):
                break  # a record still being written
            kstart = pos + _RECORD.size
            try:
                key = data[kstart : kstart + klen].decode()
            except UnicodeDecodeError:
                raise DistStoreError(f"the FileStore file {self._path} is corrupt") from None
            if op == _SET:
                self._data[key] = data[kstart + klen : end]
            elif op == _DEL:
                self._data.pop(key, None)
            else:
                raise DistStoreError(f"the FileStore file {self._path} is corrupt")
            pos = end
        self._offset += pos

    async def _sync(self) -> None:
        """Catch up with the file, taking the shared lock only when it grew."""
        if os.fstat(self._fileno()).st_size != self._offset:
            async with self._flock(exclusive=False):
                self._refresh()

    def _add_locked(self, key: str, amount: int) -> int:
        old = self._data.get(key)
        new = (0 if old is None else parse_counter(key, old)) + amount
        if not INT64_MIN <= new <= INT64_MAX:
            raise DistValueError(f"add({key!r}, {amount}) would leave the 64-bit range")
        self._append([(_SET, key, str(new).encode())])
        return new

    async def _wait(self, op: str, keys: list[str], timeout: float) -> None:
        await self.start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        delay = _FIRST_POLL
        while True:
            await self._sync()
            missing = [k for k in keys if k not in self._data]
            if not missing:
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise keys_timeout_error(op, missing, timeout, f"FileStore {self._path}")
            await asyncio.sleep(min(delay, remaining))
            delay = min(delay * 2, _MAX_POLL)

    # -- operations ----------------------------------------------------------------------
    async def set(self, key: str, value: Value) -> None:
        key, data = validate_key(key), as_bytes(value)
        await self.start()
        async with self._flock(exclusive=True):
            self._append([(_SET, key, data)])

    async def get(self, key: str) -> bytes:
        key = validate_key(key)
        await self._wait("get", [key], self._timeout)
        return self._data[key]

    async def add(self, key: str, amount: int) -> int:
        key, amount = validate_key(key), check_amount(amount)
        await self.start()
        async with self._flock(exclusive=True):
            self._refresh()
            return self._add_locked(key, amount)

    async def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        key = validate_key(key)
        exp, des = as_bytes(expected, "expected"), as_bytes(desired, "desired")
        await self.start()
        async with self._flock(exclusive=True):
            self._refresh()
            current = self._data.get(key)
            if (current is None and not exp) or current == exp:
                self._append([(_SET, key, des)])
                return des
            return exp if current is None else current

    async def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        key_list = validate_keys(keys)
        await self._wait("wait", key_list, self._timeout if timeout is None else as_seconds(timeout))

    async def check(self, keys: Sequence[str]) -> bool:
        key_list = validate_keys(keys)
        await self.start()
        await self._sync()
        return all(k in self._data for k in key_list)

    async def delete_key(self, key: str) -> bool:
        key = validate_key(key)
        await self.start()
        async with self._flock(exclusive=True):
            self._refresh()
            if key not in self._data:
                return False
            self._append([(_DEL, key, b"")])
            return True

    async def num_keys(self) -> int:
        await self.start()
        await self._sync()
        return sum(1 for k in self._data if not k.startswith(_INTERNAL))

    async def append(self, key: str, value: Value) -> None:
        key, data = validate_key(key), as_bytes(value)
        await self.start()
        async with self._flock(exclusive=True):
            self._refresh()
            self._append([(_SET, key, self._data.get(key, b"") + data)])

    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        key_list = validate_keys(keys)
        await self._wait("multi_get", key_list, self._timeout)
        return [self._data[k] for k in key_list]

    async def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        key_list, data = check_multi_set(keys, values)
        await self.start()
        async with self._flock(exclusive=True):
            self._append([(_SET, k, v) for k, v in zip(key_list, data, strict=True)])
