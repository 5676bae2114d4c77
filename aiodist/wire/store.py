"""The store protocol: its requests and responses as data, pure codecs, and its limits.

Shared by the server and the client (``aiodist.store``). After the handshake of
``aiodist.wire.handshake`` (job ``"aiodist-store"``), one frame per message, values travelling
as the frame payload, never inside msgpack::

    request : [op, rid, keys, lens, arg]      payload = the values, concatenated
    response: [rid, status, lens, result]     payload = the values, concatenated

``rid`` is chosen by the client and unique per connection, so one connection carries many
concurrent requests; responses come back in any order. ``status`` is ``"ok"``, ``"timeout"``
(``result`` lists missing keys), ``"value_error"`` or ``"error"`` (``result`` is a message).
A ``"cancel"`` request (``arg`` = the rid) withdraws a waiting request and gets no response.
A server that shuts down in order sends ``[0, "closing", [], None]`` (rid 0 is never a
request's). ``decode_request`` and ``decode_response`` raise ``ProtocolError`` on anything else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiodist.wire.frames import Limits, ProtocolError, encode_frame

__all__ = [
    "CLIENT_LIMITS",
    "CLOSING_RID",
    "HANDSHAKE_LIMITS",
    "JOB",
    "MAX_KEY_BYTES",
    "MAX_REQUEST_KEYS",
    "MAX_VALUE_BYTES",
    "OPS",
    "SERVER_LIMITS",
    "OpShape",
    "Request",
    "Response",
    "decode_request",
    "decode_response",
    "encode_closing",
    "encode_request",
    "encode_response",
]

JOB = "aiodist-store"
MAX_VALUE_BYTES = 64 << 20
MAX_KEY_BYTES = 64 << 10
MAX_REQUEST_KEYS = 8192
# compare_set carries two values in one frame, hence twice the value limit.
SERVER_LIMITS = Limits(
    max_header=1 << 20,
    max_payload=2 * MAX_VALUE_BYTES,
    max_str=MAX_KEY_BYTES,
    max_bin=64,
    max_array=2 * MAX_REQUEST_KEYS,
    max_map=0,
)
# The client trusts the server it authenticated; a multi_get answer may exceed one value.
CLIENT_LIMITS = Limits(
    max_header=4 << 20,
    max_payload=1 << 40,
    max_str=MAX_KEY_BYTES,
    max_bin=64,
    max_array=2 * MAX_REQUEST_KEYS,
    max_map=0,
)
# Before authentication nothing but tiny handshake messages is accepted (nothing is allocated
# beyond the reader's small scratch buffer).
HANDSHAKE_LIMITS = Limits(max_header=1024, max_payload=0, max_str=512, max_bin=64, max_array=8, max_map=0)

# The range of ``add``'s amount (the store's counters are signed 64-bit, as torch's).
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
CLOSING_RID = 0  # the rid of the server's "closing" notice; no request's


@dataclass(frozen=True, slots=True)
class OpShape:
    """What a request of one operation carries."""

    keys: int  # exact number of keys, or -1 for any
    values: int  # exact number of values, -1 for "one per key"
    arg: str  # "none", "timeout", "int"
    waits: bool  # may block until keys appear


OPS: dict[str, OpShape] = {
    "set": OpShape(1, 1, "none", False),
    "get": OpShape(1, 0, "timeout", True),
    "add": OpShape(1, 0, "int", False),
    "compare_set": OpShape(1, 2, "none", False),
    "wait": OpShape(-1, 0, "timeout", True),
    "check": OpShape(-1, 0, "none", False),
    "delete_key": OpShape(1, 0, "none", False),
    "num_keys": OpShape(0, 0, "none", False),
    "append": OpShape(1, 1, "none", False),
    "multi_get": OpShape(-1, 0, "timeout", True),
    "multi_set": OpShape(-1, -1, "none", False),
    "cancel": OpShape(0, 0, "int", False),
}


@dataclass(frozen=True, slots=True)
class Request:
    """One request: ``op`` on ``keys`` with ``values`` and ``arg`` (see ``OPS``)."""

    op: str
    rid: int
    keys: list[str]
    values: list[bytes]
    arg: Any


@dataclass(frozen=True, slots=True)
class Response:
    """The answer to request ``rid``; its values are slices of ``payload`` (``lens`` bytes each)."""

    rid: int
    status: str
    lens: list[int]
    result: Any
    payload: memoryview

    @property
    def closing(self) -> bool:
        """The server's notice that it shuts down in order (not an answer to a request)."""
        return self.rid == CLOSING_RID and self.status == "closing"

    def values(self) -> list[bytes]:
        return _split(self.payload, self.lens)


def _split(payload: memoryview, lens: list[int]) -> list[bytes]:
    out, pos = [], 0
    for n in lens:
        out.append(bytes(payload[pos : pos + n]))
        pos += n
    return out


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def encode_request(
    op: str, rid: int, keys: list[str], values: Sequence[bytes] = (), arg: Any = None
) -> bytes:
    """Prefix and header of a request's frame; the caller writes ``values`` after it."""
    return encode_frame([op, rid, keys, [len(v) for v in values], arg], sum(map(len, values)))


def encode_response(rid: int, status: str, result: Any = None, values: Sequence[bytes] = ()) -> bytes:
    """Prefix and header of a response's frame; the caller writes ``values`` after it."""
    return encode_frame([rid, status, [len(v) for v in values], result], sum(len(v) for v in values))


def encode_closing() -> bytes:
    """The server's notice that it shuts down in order."""
    return encode_response(CLOSING_RID, "closing")


def decode_request(header: Any, payload: memoryview) -> Request:
    """Validate one request frame; anything unexpected is a ``ProtocolError`` (the connection dies)."""
    if not (isinstance(header, list) and len(header) == 5):
        raise ProtocolError("malformed store request")
    op, rid, keys, lens, arg = header
    shape = OPS.get(op) if isinstance(op, str) else None
    if shape is None:
        raise ProtocolError(f"unknown store operation {str(op)[:40]!r}")
    if not _is_int(rid):
        raise ProtocolError("malformed store request id")
    if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        raise ProtocolError(f"malformed keys in store request {op}")
    if not (
        isinstance(lens, list) and all(_is_int(n) and n >= 0 for n in lens) and sum(lens) == len(payload)
    ):
        raise ProtocolError(f"value lengths of store request {op} do not match its payload")
    if shape.keys >= 0 and len(keys) != shape.keys:
        raise ProtocolError(f"store request {op} needs {shape.keys} keys, got {len(keys)}")
    if len(lens) != (len(keys) if shape.values < 0 else shape.values):
        raise ProtocolError(f"store request {op} carries {len(lens)} values")
    if shape.arg == "none" and arg is not None:
        raise ProtocolError(f"store request {op} takes no argument")
    if shape.arg == "int" and not (_is_int(arg) and _INT64_MIN <= arg <= _INT64_MAX):
        raise ProtocolError(f"store request {op} needs an integer argument")
    if shape.arg == "timeout" and not (
        isinstance(arg, int | float) and not isinstance(arg, bool) and arg >= 0
    ):
        raise ProtocolError(f"store request {op} needs a non-negative timeout")
    return Request(op, rid, keys, _split(payload, lens), arg)


def decode_response(header: Any, payload: memoryview) -> Response:
    """Validate one response frame (or the closing notice); ``ProtocolError`` on anything else."""
    if not (isinstance(header, list) and len(header) == 4 and isinstance(header[0], int)):
        raise ProtocolError("malformed store response")
    rid, status, lens, result = header
    if rid == CLOSING_RID and status == "closing":
        return Response(rid, status, [], None, payload)
    if not (isinstance(lens, list) and all(isinstance(n, int) and n >= 0 for n in lens)) or sum(lens) != len(
        payload
    ):
        raise ProtocolError("store response lengths do not match its payload")
    return Response(rid, str(status), lens, result, payload)
