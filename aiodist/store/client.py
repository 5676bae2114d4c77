"""``TCPStore``: the async client of ``StoreServer`` (and, with ``is_master``, its host).

One authenticated connection carries every request of the client, each with its own request
id, so any number of tasks may wait in ``get``/``wait`` at once. The connection is opened on
first use (or by ``start()``), retrying with capped exponential backoff until the store timeout.
If the server goes away, every pending and later call raises ``DistStoreError`` at once: the
client never reconnects behind the caller's back, because a new server would not hold the keys
the job already wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
from collections.abc import Iterator, Sequence
from typing import Any

from aiodist import settings as _settings
from aiodist.errors import DistStoreError, DistTypeError, DistValueError
from aiodist.store.base import (
    DEFAULT_TIMEOUT,
    PORT_ADVICE,
    ForeignStoreError,
    Store,
    StoreShutDownError,
    Timeout,
    Value,
    as_bytes,
    as_seconds,
    check_amount,
    check_multi_set,
    keys_timeout_error,
    validate_key,
    validate_keys,
)
from aiodist.store.server import StoreServer
from aiodist.wire.frames import FrameReader, ProtocolError, encode_frame
from aiodist.wire.handshake import (
    AuthError,
    make_hello,
    parse_challenge,
    verify_welcome,
)
from aiodist.wire.store import (
    CLIENT_LIMITS,
    HANDSHAKE_LIMITS,
    JOB,
    MAX_KEY_BYTES,
    MAX_REQUEST_KEYS,
    MAX_VALUE_BYTES,
    Response,
    decode_response,
    encode_request,
)

__all__ = ["TCPStore"]

_FIRST_BACKOFF = 0.05
_MAX_BACKOFF = 1.0
# How long past a waiting call's timeout we wait for the server's own timeout answer before
# concluding that the server is stuck.
_GRACE = 2.0
# A store server sends its challenge the moment it accepts; a listener that stays silent this
# long, or keeps closing connections without a word, is another program holding the port.
SILENCE_VERDICT = 3.0
# The second look a silent listener gets once the verdict is due (see ``_handshake``).
_LAST_LOOK = 0.25
_KEY_BYTES_PER_REQUEST = 256 << 10
_PAYLOAD_PER_REQUEST = 2 * MAX_VALUE_BYTES


def _collect(_header: Any, _payload_len: int) -> memoryview | None:
    return None


class _NotAStore(ProtocolError):
    """The listener answered, or stayed silent, in a way no store server does."""


class _ClosedUnheard(ConnectionResetError):
    """The listener closed the connection before saying anything (a closing store does that too)."""


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return "none"
    if isinstance(exc, TimeoutError):
        return "the attempt timed out"
    text = str(exc) or exc.__class__.__name__
    return f"{exc.__class__.__name__}: {text}"


class TCPStore(Store):
    """Key-value store reached over TCP; ``is_master=True`` also runs the server in this process.

    Args:
        host: the server's address (the address to bind when ``is_master``).
        port: the server's port; with ``is_master``, 0 picks a free one (read ``port`` after
            ``start``).
        world_size: number of processes of the job (informational; no worker counting).
        is_master: start a ``StoreServer`` in this process on ``start()``.
        timeout: seconds or ``timedelta``: bounds connecting and every waiting call.
        sock: with ``is_master``, an already bound listening socket for the server.
        secret: shared secret for the handshake; ``None`` reads ``AIODIST_SECRET``, ``b""``
            disables authentication.
        handshake_timeout: seconds the server gives a connection to authenticate (None:
            ``AIODIST_HANDSHAKE_TIMEOUT``, else 10).

    Raises:
        DistTypeError, DistValueError: an argument has the wrong type or value.
    """

    def __init__(
        self,
        host: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: Timeout = DEFAULT_TIMEOUT,
        *,
        sock: socket.socket | None = None,
        secret: bytes | None = None,
        handshake_timeout: float | None = None,
    ) -> None:
        if not isinstance(host, str):
            raise DistTypeError(f"host must be a str, not {type(host).__name__}")
        if not isinstance(port, int) or isinstance(port, bool):
            raise DistTypeError(f"port must be an int, not {type(port).__name__}")
        if not 0 <= port <= 65535 or (port == 0 and not is_master):
            raise DistValueError(f"port must be in 1..65535 (0 only for the master), got {port}")
        if world_size is not None and (not isinstance(world_size, int) or world_size < 1):
            raise DistValueError(f"world_size must be None or a positive int, got {world_size!r}")
        if sock is not None and not is_master:
            raise DistValueError("sock= is the listening socket of the master; pass it with is_master=True")
        if secret is not None and not isinstance(secret, bytes):
            raise DistTypeError(f"secret must be bytes or None, not {type(secret).__name__}")
        self._host = host
        self._port = port
        self.world_size = world_size
        self.is_master = bool(is_master)
        self._timeout = as_seconds(timeout)
        self._sock = sock
        self._secret = _settings.secret() if secret is None else secret
        self._handshake_timeout = (
            _settings.handshake_timeout() if handshake_timeout is None else handshake_timeout
        )
        self._server: StoreServer | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._read_task: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[Response]] = {}
        self._next_rid = 1
        self._start_lock = asyncio.Lock()
        self._closed = False
        # Why the connection is gone (message, cause, class); every later call raises with it.
        self._failure: tuple[str, BaseException | None, type[DistStoreError]] | None = None
        self._host_closing = False  # the server said it is shutting down (not a crash)
        self.last_connect_error: BaseException | None = None  # for progress reports while connecting

    def __repr__(self) -> str:
        role = "master" if self.is_master else "client"
        state = (
            "closed"
            if self._closed
            else ("failed" if self._failure else ("open" if self._writer else "idle"))
        )
        return f"TCPStore({self._host!r}, {self.port}, {role}, {state})"

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        """The server's port; for a master started on port 0, the port it actually got."""
        return self._server.port if self._server is not None else self._port

    @property
    def server(self) -> StoreServer | None:
        """The in-process server of a started master, else None."""
        return self._server

    @property
    def _addr(self) -> str:
        return f"[{self._host}]:{self.port}" if ":" in self._host else f"{self._host}:{self.port}"

    # -- timeout -------------------------------------------------------------------------
    @property
    def timeout(self) -> float:
        return self._timeout

    def set_timeout(self, timeout: Timeout) -> None:
        self._timeout = as_seconds(timeout)

    # -- lifetime ------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the server (master) and connect, retrying until the store timeout.

        Raises:
            DistStoreError: the server could not be started, reached (the message gives
                host:port, the attempts made and the last error) or authenticated with.
        """
        if self._writer is not None and self._failure is None and not self._closed:
            return
        async with self._start_lock:
            self._raise_if_unusable()
            if self._writer is not None:
                return
            if self.is_master and self._server is None:
                server = StoreServer(
                    self._host,
                    self._port,
                    sock=self._sock,
                    secret=self._secret,
                    handshake_timeout=self._handshake_timeout,
                )
                await server.start()
                self._server = server
            await self._connect()

    async def aclose(self) -> None:
        """Close the connection (pending calls raise ``DistStoreError``); a master also stops its server."""
        if self._closed:
            return
        self._closed = True
        writer = self._writer
        self._drop_connection("the TCPStore was closed")
        if writer is not None:
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        if self._server is not None:
            await self._server.aclose()

    def abort(self) -> None:
        """Drop the connection and (master) the server at once."""
        if self._closed:
            return
        self._closed = True
        self._drop_connection("the TCPStore was aborted", abort=True)
        if self._server is not None:
            self._server.abort()

    def _drop_connection(self, why: str, abort: bool = False) -> None:
        if self._read_task is not None:
            self._read_task.cancel()
            self._read_task = None
        self._fail_pending(why, None)
        if self._writer is not None:
            if abort:
                self._writer.transport.abort()
            else:
                self._writer.close()

    def _raise_if_unusable(self) -> None:
        if self._closed:
            raise DistStoreError(f"the TCPStore for {self._addr} is closed")
        if self._failure is not None:
            msg, cause, cls = self._failure
            raise cls(msg) from cause
        if self._host_closing:
            raise StoreShutDownError(f"store at {self._addr} is closing: its host shut the store down")

    # -- connecting ----------------------------------------------------------------------
    def _connect_host(self) -> str:
        # A master bound to a wildcard address reaches its own server over loopback.
        if self.is_master and self._host in ("", "0.0.0.0"):
            return "127.0.0.1"
        if self.is_master and self._host == "::":
            return "::1"
        if self._host == "localhost":
            return "127.0.0.1"
        return self._host

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        attempts, delay = 0, _FIRST_BACKOFF
        last: BaseException | None = None
        unheard_since: float | None = None  # closed on us without a word since then, every attempt
        while True:
            if self._closed:  # closed by another task while we were retrying
                raise DistStoreError(f"the TCPStore for {self._addr} was closed while connecting")
            attempts += 1
            try:
                await self._connect_once(max(deadline - loop.time(), 0.01))
                return
            except AuthError as exc:
                raise ForeignStoreError(
                    f"authentication failed with the store at {self._addr}: {exc}. Either another aiodist "
                    f"job (with a different AIODIST_SECRET) holds {self._addr}: then {PORT_ADVICE}; or this "
                    "process's AIODIST_SECRET differs from the store host's",
                    addr=self._addr,
                    holder="job",
                    why=str(exc),
                ) from None
            except _NotAStore as exc:
                raise self._foreign(str(exc)) from None
            except (OSError, ProtocolError) as exc:  # refused, reset, unreachable
                last = self.last_connect_error = exc
                if not isinstance(exc, _ClosedUnheard):
                    unheard_since = None
                elif unheard_since is None:
                    unheard_since = loop.time()
                elif loop.time() - unheard_since >= SILENCE_VERDICT:
                    raise self._foreign(
                        f"for {SILENCE_VERDICT:g} s it accepted every connection and closed it without a word"
                    ) from None
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise DistStoreError(
                    f"could not connect to the store at {self._addr}: {attempts} attempts in "
                    f"{self._timeout:g} s failed; last error: {_describe(last)}"
                ) from last
            await asyncio.sleep(min(delay * random.uniform(0.8, 1.2), remaining))
            delay = min(delay * 2, _MAX_BACKOFF)

    def _foreign(self, why: str) -> ForeignStoreError:
        return ForeignStoreError(
            f"could not join the store at {self._addr}: the address is already in use by another program, "
            f"not an aiodist store ({why}); {PORT_ADVICE}",
            addr=self._addr,
            holder="program",
            why=why,
        )

    async def _connect_once(self, budget: float) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + budget
        async with asyncio.timeout(budget):
            reader, writer = await asyncio.open_connection(self._connect_host(), self.port)
        try:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            await self._handshake(reader, writer, end)
            if self._closed:
                raise DistStoreError(f"the TCPStore for {self._addr} was closed while connecting")
        except BaseException:
            writer.transport.abort()
            raise
        frames = FrameReader(_collect, self._on_frame, CLIENT_LIMITS)
        self._reader, self._writer = reader, writer
        self._failure = None
        self._read_task = asyncio.create_task(
            self._read_loop(reader, frames), name=f"aiodist-store-{self._addr}"
        )

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, end: float
    ) -> None:
        """Authenticate; a listener that does not open like a store server raises ``_NotAStore``.

        A store server sends its challenge as soon as it accepts, so the first message is
        awaited only ``SILENCE_VERDICT`` seconds; the rest of the handshake gets the handshake
        timeout. ``end`` is the attempt's deadline (loop time).
        """
        loop = asyncio.get_running_loop()
        frames: list[Any] = []
        fr = FrameReader(_collect, lambda h, _p: frames.append(h), HANDSHAKE_LIMITS, scratch_size=4096)
        heard = b""

        async def next_message() -> Any:
            nonlocal heard
            while not frames:
                data = await reader.read(4096)
                if not data:
                    if not heard:
                        raise _ClosedUnheard("the listener closed the connection without a word")
                    raise ConnectionResetError("the server closed the connection during the handshake")
                if len(heard) < 64:
                    heard += data[: 64 - len(heard)]
                fr.feed(data)
            return frames.pop(0)

        first_wait = min(SILENCE_VERDICT, end - loop.time())
        try:
            try:
                async with asyncio.timeout(first_wait):
                    first = await next_message()
            except TimeoutError:
                if first_wait < SILENCE_VERDICT:
                    raise  # our own budget ran out: no verdict on the listener
                # After a stall of this process the loop fires its due timers before it reads
                # its sockets: look once more at what has arrived before calling it silence.
                try:
                    async with asyncio.timeout(_LAST_LOOK):
                        first = await next_message()
                except TimeoutError:
                    raise _NotAStore(
                        f"it accepted the connection but sent nothing in {SILENCE_VERDICT:g} s"
                    ) from None
        except _NotAStore:  # (the silence verdict: already says what the listener did)
            raise
        except ProtocolError:  # not even a frame
            raise _NotAStore(f"it answered {heard[:40]!r}") from None
        try:
            challenge = parse_challenge(first)
        except ProtocolError as exc:
            if isinstance(first, list) and first[:1] == ["challenge"]:
                raise _NotAStore(f"it is an aiodist store of another version: {exc}") from None
            raise _NotAStore(f"it answered {heard[:40]!r}") from None
        hello = make_hello(challenge, JOB, -1, self._secret)
        writer.write(encode_frame(hello.pack()))
        async with asyncio.timeout(max(0.001, min(end - loop.time(), self._handshake_timeout))):
            welcome = await next_message()
        verify_welcome(challenge, hello, welcome, JOB, self._secret)
        if frames or fr.mid_frame:
            raise ProtocolError("the server sent unexpected bytes after its handshake welcome")

    # -- the connection ------------------------------------------------------------------
    async def _read_loop(self, reader: asyncio.StreamReader, frames: FrameReader) -> None:
        cause: BaseException | None = None
        msg = f"store at {self._addr} closed the connection"
        cls = DistStoreError
        try:
            while True:
                data = await reader.read(256 * 1024)
                if not data:
                    break
                frames.feed(data)
        except OSError as exc:
            cause = exc
        except ProtocolError as exc:
            cause, msg = exc, f"store at {self._addr} sent a malformed message: {exc}"
        if self._host_closing:  # (a reset after the notice is part of the same shutdown)
            msg, cls = f"{msg}: its host shut the store down", StoreShutDownError
        self._failure = (msg, cause, cls)
        self._read_task = None
        self._fail_pending(msg, cause, cls)
        if self._writer is not None:
            self._writer.transport.abort()

    def _on_frame(self, header: Any, payload: memoryview) -> None:
        resp = decode_response(header, payload)
        if resp.closing:  # the server's notice that it shuts down in order
            self._host_closing = True
            # Half-close, so that the server closes a socket with nothing unread (no reset).
            if self._writer is not None and self._writer.can_write_eof():
                with contextlib.suppress(OSError):
                    self._writer.write_eof()
            return
        fut = self._pending.pop(resp.rid, None)
        if fut is not None and not fut.done():  # else: a request we withdrew
            fut.set_result(resp)

    def _fail_pending(
        self, msg: str, cause: BaseException | None, cls: type[DistStoreError] = DistStoreError
    ) -> None:
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                err = cls(msg)
                err.__cause__ = cause
                fut.set_exception(err)

    def _withdraw(self, rid: int) -> None:
        """Forget a request we stopped waiting for, and tell the server to drop it."""
        self._pending.pop(rid, None)
        if self._writer is not None and self._failure is None and not self._writer.is_closing():
            cancel_rid, self._next_rid = self._next_rid, self._next_rid + 1
            self._writer.write(encode_request("cancel", cancel_rid, [], (), rid))

    async def _call(
        self,
        op: str,
        keys: list[str],
        values: Sequence[bytes] = (),
        arg: Any = None,
        wait: float | None = None,
        asked: float | None = None,
    ) -> Response:
        """Send one request and wait for its response.

        ``wait`` is the time the server was told to wait (for waiting ops); ``asked`` the timeout
        the caller gave, for the error message.
        """
        await self.start()
        self._raise_if_unusable()
        writer = self._writer
        if writer is None:  # start() returned without a connection only if it raised
            raise DistStoreError(f"the TCPStore for {self._addr} is not connected")
        rid, self._next_rid = self._next_rid, self._next_rid + 1
        fut: asyncio.Future[Response] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        writer.writelines([encode_request(op, rid, keys, values, arg), *values])
        try:
            with contextlib.suppress(OSError):  # a lost connection is reported by the read loop
                await writer.drain()
            if wait is None or wait == float("inf"):
                resp = await fut
            else:
                try:
                    async with asyncio.timeout(wait + _GRACE):
                        resp = await fut
                except TimeoutError:
                    raise DistStoreError(
                        f"store at {self._addr} did not answer {op} within {wait + _GRACE:g} s"
                    ) from None
        except BaseException:
            # Still pending means no answer came (cancelling us also cancelled ``fut``).
            if rid in self._pending:
                self._withdraw(rid)
            raise
        if resp.status == "ok":
            return resp
        if resp.status == "timeout":
            missing = [str(k) for k in resp.result] if isinstance(resp.result, list) else keys
            raise keys_timeout_error(
                op, missing, float(arg if asked is None else asked), f"store at {self._addr}"
            )
        if resp.status == "value_error":
            raise DistValueError(str(resp.result))
        raise DistStoreError(f"store at {self._addr} failed {op}: {resp.result}")

    # -- operations ----------------------------------------------------------------------
    async def set(self, key: str, value: Value) -> None:
        await self._call("set", [_key(key)], [_value(value)])

    async def get(self, key: str) -> bytes:
        timeout = self._timeout
        resp = await self._call("get", [_key(key)], arg=timeout, wait=timeout)
        return bytes(resp.payload)

    async def add(self, key: str, amount: int) -> int:
        resp = await self._call("add", [_key(key)], arg=check_amount(amount))
        return int(resp.result)

    async def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        values = [_value(expected, "expected"), _value(desired, "desired")]
        resp = await self._call("compare_set", [_key(key)], values)
        return bytes(resp.payload)

    async def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        t = self._timeout if timeout is None else as_seconds(timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + t
        for chunk, _ in _chunks(_keys(keys)):
            # Later chunks get what is left of the one timeout (the server reports missing keys).
            left = t if t == float("inf") else max(deadline - loop.time(), 0.0)
            await self._call("wait", chunk, arg=left, wait=left, asked=t)

    async def check(self, keys: Sequence[str]) -> bool:
        for chunk, _ in _chunks(_keys(keys)):
            resp = await self._call("check", chunk)
            if not resp.result:
                return False
        return True

    async def delete_key(self, key: str) -> bool:
        resp = await self._call("delete_key", [_key(key)])
        return bool(resp.result)

    async def num_keys(self) -> int:
        resp = await self._call("num_keys", [])
        return int(resp.result)

    async def append(self, key: str, value: Value) -> None:
        await self._call("append", [_key(key)], [_value(value)])

    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        t = self._timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + t
        out: list[bytes] = []
        for chunk, _ in _chunks(_keys(keys)):
            left = t if t == float("inf") else max(deadline - loop.time(), 0.0)
            resp = await self._call("multi_get", chunk, arg=left, wait=left, asked=t)
            out.extend(resp.values())
        return out

    async def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        key_list, data = check_multi_set(keys, values)
        for k, v in zip(key_list, data, strict=True):
            _check_sizes(k, v)
        for chunk, vals in _chunks(key_list, data):
            await self._call("multi_set", chunk, vals)


def _check_sizes(key: str, value: bytes | None = None) -> None:
    if len(key) * 4 > MAX_KEY_BYTES and len(key.encode()) > MAX_KEY_BYTES:
        raise DistValueError(f"key of {len(key.encode())} bytes exceeds the store limit of {MAX_KEY_BYTES}")
    if value is not None and len(value) > MAX_VALUE_BYTES:
        raise DistValueError(f"value of {len(value)} bytes exceeds the store limit of {MAX_VALUE_BYTES}")


def _key(key: object) -> str:
    k = validate_key(key)
    _check_sizes(k)
    return k


def _keys(keys: object) -> list[str]:
    ks = validate_keys(keys)
    for k in ks:
        _check_sizes(k)
    return ks


def _value(value: object, what: str = "value") -> bytes:
    v = as_bytes(value, what)
    _check_sizes("", v)
    return v


def _chunks(keys: list[str], values: list[bytes] | None = None) -> Iterator[tuple[list[str], list[bytes]]]:
    """Split a many-key request into requests that fit the server's frame limits.

    An empty key list still yields one (empty) request, so that e.g. ``wait([])`` round-trips.
    """
    start, key_bytes, payload = 0, 0, 0
    for i, k in enumerate(keys):
        kb = len(k.encode()) + 8
        vb = len(values[i]) if values is not None else 0
        if i > start and (
            i - start >= MAX_REQUEST_KEYS
            or key_bytes + kb > _KEY_BYTES_PER_REQUEST
            or payload + vb > _PAYLOAD_PER_REQUEST
        ):
            yield keys[start:i], (values[start:i] if values is not None else [])
            start, key_bytes, payload = i, 0, 0
        key_bytes += kb
        payload += vb
    if start < len(keys) or not keys:
        yield keys[start:], (values[start:] if values is not None else [])
