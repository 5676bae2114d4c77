"""The TCP store server, and the request/response protocol it speaks with ``TCPStore``.

The protocol (requests, responses, the closing notice) is ``aiodist.wire.store``: one frame per
message, values travelling as the frame payload; requests carry a client-chosen id, so one
connection carries many concurrent requests, answered in any order.

The server survives any client: a connection that breaks the protocol, fails the handshake or
does not finish it within ``handshake_timeout`` is dropped with one rate-limited warning that
names the remote address; unauthenticated connections are capped.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import math
import os
import socket
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self

from aiodist import settings as _settings
from aiodist.errors import DistStoreError, DistValueError
from aiodist.store.memory import KeyTable
from aiodist.wire.frames import FrameReader, Limits, ProtocolError, encode_frame
from aiodist.wire.handshake import (
    AuthError,
    Refusal,
    accept_hello,
    make_challenge,
    make_welcome,
)
from aiodist.wire.store import (
    CLIENT_LIMITS,
    HANDSHAKE_LIMITS,
    JOB,
    MAX_KEY_BYTES,
    MAX_REQUEST_KEYS,
    MAX_VALUE_BYTES,
    OPS,
    SERVER_LIMITS,
    Request,
    decode_request,
    encode_closing,
    encode_response,
)

__all__ = [
    "CLIENT_LIMITS",
    "HANDSHAKE_LIMITS",
    "JOB",
    "MAX_KEY_BYTES",
    "MAX_REQUEST_KEYS",
    "MAX_VALUE_BYTES",
    "SERVER_LIMITS",
    "StoreServer",
]

log = logging.getLogger("aiodist.store")

_MAX_WAITS_PER_CONNECTION = 1 << 16
# How long ``aclose`` lets clients close their end after the "closing" notice. Closing a socket
# that still holds unread bytes makes the kernel reset it, and a reset can overtake the notice,
# so the client would see a crash instead of an orderly shutdown.
_CLOSE_GRACE = 0.5
_TIMEOUT_KEYS_REPORTED = 64


def _peer_name(writer: asyncio.StreamWriter) -> tuple[str, str]:
    """(host, "host:port") of the remote end, for logs."""
    peer = writer.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = str(peer[0])
        return host, (f"[{host}]:{peer[1]}" if ":" in host else f"{host}:{peer[1]}")
    return "?", str(peer)


class _WarnLimiter:
    """At most one warning per remote host per ``interval``; counts what it held back."""

    def __init__(self, interval: float = 10.0, max_hosts: int = 4096) -> None:
        self._interval = interval
        self._max_hosts = max_hosts
        self._last: dict[str, list[float]] = {}  # host -> [time of last warning, suppressed count]

    def warn(self, host: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        entry = self._last.get(host)
        if entry is not None and now - entry[0] < self._interval:
            entry[1] += 1
            return
        suppressed = int(entry[1]) if entry is not None else 0
        if len(self._last) >= self._max_hosts:
            self._last.clear()  # bounded memory under a flood from many addresses
        self._last[host] = [now, 0]
        if suppressed:
            msg += f" ({suppressed} similar warnings suppressed)"
        log.warning(msg, *args)


class _Conn:
    """One client connection: its streams, its waiting requests, and how it must end."""

    __slots__ = ("addr", "authenticated", "host", "poisoned", "reader", "tasks", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.host, self.addr = _peer_name(writer)
        self.tasks: dict[int, asyncio.Task[None]] = {}
        # A poisoned connection is aborted (RST, buffers dropped) instead of closed gracefully.
        self.poisoned = False
        self.authenticated = False

    def send(self, frame: bytes, values: Sequence[bytes] = ()) -> None:
        """Write one frame (prefix and header, encoded by ``aiodist.wire``) and its values."""
        if self.writer.is_closing():
            return
        self.writer.writelines([frame, *values])

    def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        self.tasks.clear()
        if self.poisoned:
            self.writer.transport.abort()
        else:
            self.writer.close()


_warned_insecure = False  # the no-secret warning is given once per process


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return host == "localhost"


def _bind_host(host: str) -> str:
    # "localhost" may resolve to ::1 and 127.0.0.1; bind the one clients reach first everywhere.
    return "127.0.0.1" if host == "localhost" else host


class StoreServer:
    """The asyncio TCP key-value server behind ``TCPStore``.

    Args:
        host: address to bind (``"localhost"`` binds 127.0.0.1; ``""``/``"0.0.0.0"`` all IPv4).
        port: port to bind; 0 picks a free one (see ``port`` after ``start``).
        sock: an already bound listening socket to serve on instead of ``host``/``port``.
        secret: shared secret for the HMAC handshake; ``None`` reads ``AIODIST_SECRET``,
            ``b""`` disables authentication.
        handshake_timeout: seconds a new connection has to authenticate before it is dropped
            (None: ``AIODIST_HANDSHAKE_TIMEOUT``, else 10).
        max_unauthenticated: connections allowed to be mid-handshake at once; more are dropped.
        limits: frame limits for authenticated connections.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        sock: socket.socket | None = None,
        secret: bytes | None = None,
        handshake_timeout: float | None = None,
        max_unauthenticated: int = 256,
        limits: Limits = SERVER_LIMITS,
    ) -> None:
        self._host = host
        self._port = port
        self._sock = sock
        self._secret = _settings.secret() if secret is None else secret
        self._handshake_timeout = (
            _settings.handshake_timeout() if handshake_timeout is None else handshake_timeout
        )
        self._max_unauthenticated = max_unauthenticated
        self._limits = limits
        self._table = KeyTable()
        self._server: asyncio.Server | None = None
        self._bound_port: int | None = None  # kept after closing, for messages
        self._closed = False
        self._conns: set[_Conn] = set()
        self._handlers: set[asyncio.Task[Any]] = set()
        self._unauthenticated = 0
        self._warner = _WarnLimiter()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("serving" if self._server else "not started")
        return f"StoreServer({self._host!r}, {self.port}, {state}, {len(self._conns)} connections)"

    @property
    def port(self) -> int:
        """The port served on (the real one once started, even when 0 was asked)."""
        if self._bound_port is not None:
            return self._bound_port
        if self._sock is not None:
            return int(self._sock.getsockname()[1])
        return self._port

    @property
    def host(self) -> str:
        return self._host

    @property
    def num_connections(self) -> int:
        """Open client connections (authenticated or not)."""
        return len(self._conns)

    # -- lifetime ------------------------------------------------------------------------
    async def start(self) -> None:
        """Bind and start accepting connections.

        Raises:
            DistStoreError: the address cannot be bound (the message names it and the cause).
        """
        if self._server is not None:
            return
        if self._closed:
            raise DistStoreError("the store server is closed")
        try:
            if self._sock is not None:
                self._server = await asyncio.start_server(self._on_connect, sock=self._sock, backlog=2048)
            else:
                self._server = await asyncio.start_server(
                    self._on_connect, host=_bind_host(self._host), port=self._port, backlog=2048
                )
            if None in self._server.sockets:
                # uvloop reports a failed listen() by closing the handle, not by raising. With
                # SO_REUSEADDR two processes can both bind a port; the later listen() then fails.
                self._server.close()
                self._server = None
                raise OSError(errno.EADDRINUSE, os.strerror(errno.EADDRINUSE))
        except OSError as exc:
            raise DistStoreError(
                f"could not start the store server on {self._host}:{self._port}: {exc}"
            ) from exc
        if self._server.sockets:
            self._bound_port = int(self._server.sockets[0].getsockname()[1])
        log.debug("store server listening on %s:%d", self._host, self.port)
        global _warned_insecure
        if (
            not self._secret
            and not _warned_insecure
            and not all(_is_loopback(s.getsockname()[0]) for s in self._server.sockets)
        ):
            _warned_insecure = True
            log.warning(
                "store server on %s:%d has no AIODIST_SECRET: anyone who reaches it can read and write "
                "the job's keys",
                self._host,
                self.port,
            )

    async def aclose(self) -> None:
        """Stop accepting, close every connection (their clients see the store go away), and wait."""
        if self._closed:
            return
        self._closed = True
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for conn in self._conns:
            if conn.authenticated:  # "shutting down in order": a client may look for a later store
                conn.send(encode_closing())
        handlers = list(self._handlers)
        if handlers:  # clients half-close on the notice; their handlers then end on their own
            await asyncio.wait(handlers, timeout=_CLOSE_GRACE)
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        if server is not None:
            await server.wait_closed()

    def abort(self) -> None:
        """Stop at once: abort every connection and the listener without waiting."""
        if self._closed:
            return
        self._closed = True
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for conn in list(self._conns):
            conn.poisoned = True
            conn.writer.transport.abort()
        for task in list(self._handlers):
            task.cancel()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # -- connections ---------------------------------------------------------------------
    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(reader, writer)
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        self._conns.add(conn)
        try:
            if self._closed:
                conn.poisoned = True
                return
            await self._run(conn)
        except asyncio.CancelledError:
            pass  # the server is closing; this task is ours and ends here
        except ProtocolError as exc:
            conn.poisoned = True
            self._warner.warn(conn.host, "store server dropped %s: %s", conn.addr, exc)
        except OSError as exc:  # reset, broken pipe: the client vanished
            conn.poisoned = True
            if conn.authenticated:
                log.info("store client %s vanished: %s", conn.addr, exc)
            else:
                self._warner.warn(
                    conn.host, "store server: %s vanished during the handshake: %s", conn.addr, exc
                )
        except Exception as exc:  # never let one connection take the server down
            conn.poisoned = True
            self._warner.warn(
                conn.host, "store server dropped %s after an internal error: %r", conn.addr, exc
            )
        finally:
            conn.close()
            self._conns.discard(conn)
            if task is not None:
                self._handlers.discard(task)

    async def _run(self, conn: _Conn) -> None:
        if self._unauthenticated >= self._max_unauthenticated:
            conn.poisoned = True
            self._warner.warn(
                conn.host,
                "store server refused %s: %d connections are already waiting to authenticate",
                conn.addr,
                self._unauthenticated,
            )
            return
        self._unauthenticated += 1
        try:
            async with asyncio.timeout(self._handshake_timeout):
                authenticated = await self._handshake(conn)
        except TimeoutError:
            conn.poisoned = True
            self._warner.warn(
                conn.host,
                "store server dropped %s: no handshake within %g s",
                conn.addr,
                self._handshake_timeout,
            )
            return
        finally:
            self._unauthenticated -= 1
        if authenticated:
            conn.authenticated = True
            if self._closed:  # welcomed while aclose ran: it missed the notice the others got
                conn.send(encode_closing())
            await self._serve(conn)

    async def _handshake(self, conn: _Conn) -> bool:
        challenge = make_challenge()
        conn.send(encode_frame(challenge.pack()))
        frames: list[Any] = []
        reader = FrameReader(_collect, lambda h, _p: frames.append(h), HANDSHAKE_LIMITS, scratch_size=4096)
        while not frames:
            data = await conn.reader.read(4096)
            if not data:
                self._warner.warn(
                    conn.host, "store server: %s closed the connection before the handshake", conn.addr
                )
                return False
            reader.feed(data)
        # A client says nothing more until it is welcomed; extra bytes are not a client of ours.
        if len(frames) > 1 or reader.mid_frame:
            raise ProtocolError("unexpected bytes after the handshake hello")
        try:
            hello = accept_hello(challenge, frames[0], JOB, self._secret)
        except AuthError as exc:
            conn.send(encode_frame(Refusal(f"authentication failed: {str(exc)[:200]}").pack()))
            # (rate-limited apart from garbage: a refused secret must not hide behind noise)
            self._warner.warn(f"{conn.host} auth", "store server refused %s: %s", conn.addr, exc)
            return False
        conn.send(encode_frame(make_welcome(challenge, hello, JOB, -1, self._secret).pack()))
        return True

    async def _serve(self, conn: _Conn) -> None:
        frames: list[tuple[Any, memoryview]] = []
        reader = FrameReader(_collect, lambda h, p: frames.append((h, p)), self._limits)
        while True:
            data = await conn.reader.read(256 * 1024)
            if not data:
                return
            reader.feed(data)
            for header, payload in frames:
                self._dispatch(conn, decode_request(header, payload))
            frames.clear()
            await conn.writer.drain()

    # -- requests ------------------------------------------------------------------------
    def _dispatch(self, conn: _Conn, req: Request) -> None:
        if req.op == "cancel":
            task = conn.tasks.pop(req.arg, None)
            if task is not None:
                task.cancel()
            return
        if OPS[req.op].waits:
            if req.rid in conn.tasks:
                raise ProtocolError(f"request id {req.rid} is already in use")
            if self._table.check(req.keys) or req.arg == 0:
                self._answer_wait(conn, req, self._table.missing(req.keys))
                return
            if len(conn.tasks) >= _MAX_WAITS_PER_CONNECTION:
                raise ProtocolError(
                    f"more than {_MAX_WAITS_PER_CONNECTION} waiting requests on one connection"
                )
            task = asyncio.create_task(self._wait(conn, req))
            conn.tasks[req.rid] = task
            task.add_done_callback(
                lambda t: conn.tasks.pop(req.rid, None) if conn.tasks.get(req.rid) is t else None
            )
            return
        try:
            result, values = self._apply(req)
        except DistValueError as exc:
            conn.send(encode_response(req.rid, "value_error", str(exc)[:4096]))
            return
        conn.send(encode_response(req.rid, "ok", result, values), values)

    def _apply(self, req: Request) -> tuple[Any, list[bytes]]:
        t, keys, values = self._table, req.keys, req.values
        match req.op:
            case "set":
                t.set(keys[0], values[0])
            case "add":
                return t.add(keys[0], req.arg), []
            case "compare_set":
                return None, [t.compare_set(keys[0], values[0], values[1])]
            case "check":
                return t.check(keys), []
            case "delete_key":
                return t.delete(keys[0]), []
            case "num_keys":
                return t.num_keys(), []
            case "append":
                t.append(keys[0], values[0])
            case "multi_set":
                t.multi_set(keys, values)
            case _:  # decode_request admits no other op
                raise ProtocolError(f"unknown store operation {req.op!r}")
        return None, []

    async def _wait(self, conn: _Conn, req: Request) -> None:
        timeout = float(req.arg)
        missing = await self._table.wait(req.keys, math.inf if math.isinf(timeout) else timeout)
        self._answer_wait(conn, req, missing)

    def _answer_wait(self, conn: _Conn, req: Request, missing: list[str]) -> None:
        if missing:
            conn.send(encode_response(req.rid, "timeout", missing[:_TIMEOUT_KEYS_REPORTED]))
        elif req.op == "wait":
            conn.send(encode_response(req.rid, "ok"))
        else:
            values = self._table.values(req.keys)
            conn.send(encode_response(req.rid, "ok", None, values), values)


def _collect(_header: Any, _payload_len: int) -> memoryview | None:
    return None  # let the reader collect the payload into a fresh buffer
