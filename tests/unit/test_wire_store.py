"""The store protocol's codecs: round trips, every malformed shape, every split."""

from __future__ import annotations

from typing import Any

import pytest

from aiodist.wire.frames import FrameReader, ProtocolError, encode_frame
from aiodist.wire.store import (
    OPS,
    Request,
    decode_request,
    decode_response,
    encode_closing,
    encode_request,
    encode_response,
)

REQUESTS: list[Request] = [
    Request("set", 1, ["k"], [b"value"], None),
    Request("get", 2, ["k"], [], 1.5),
    Request("add", 3, ["n"], [], -(1 << 63)),
    Request("compare_set", 4, ["k"], [b"old", b""], None),
    Request("wait", 5, ["a", "b", "c"], [], 0),
    Request("check", 6, [], [], None),
    Request("delete_key", 7, ["k"], [], None),
    Request("num_keys", 8, [], [], None),
    Request("append", 9, ["k"], [b"more"], None),
    Request("multi_get", 10, ["a", "b"], [], float("inf")),
    Request("multi_set", 11, ["a", "b"], [b"1", b"22"], None),
    Request("cancel", 12, [], [], 5),
]


def _frames(data: bytes) -> list[tuple[Any, memoryview]]:
    got: list[tuple[Any, memoryview]] = []
    reader = FrameReader(lambda h, n: None, lambda h, p: got.append((h, p)))
    assert reader.feed(data) == len(data)
    assert not reader.mid_frame
    return got


def _request_frame(req: Request) -> bytes:
    return encode_request(req.op, req.rid, req.keys, req.values, req.arg) + b"".join(req.values)


def test_every_operation_has_a_request() -> None:
    assert {r.op for r in REQUESTS} == set(OPS)


@pytest.mark.parametrize("req", REQUESTS, ids=lambda r: r.op)
def test_request_round_trip(req: Request) -> None:
    [(header, payload)] = _frames(_request_frame(req))
    assert decode_request(header, payload) == req


def test_the_bytes_are_the_positional_lists_of_before() -> None:
    assert encode_request("set", 1, ["k"], [b"abc"]) == encode_frame(["set", 1, ["k"], [3], None], 3)
    assert encode_response(4, "ok", 7, [b"ab", b"c"]) == encode_frame([4, "ok", [2, 1], 7], 3)
    assert encode_closing() == encode_frame([0, "closing", [], None])


@pytest.mark.parametrize(
    ("status", "result", "values"),
    [
        ("ok", None, [b"v1", b"", b"v333"]),
        ("ok", 12, []),
        ("timeout", ["a", "b"], []),
        ("value_error", "no", []),
    ],
)
def test_response_round_trip(status: str, result: Any, values: list[bytes]) -> None:
    [(header, payload)] = _frames(encode_response(9, status, result, values) + b"".join(values))
    resp = decode_response(header, payload)
    assert (resp.rid, resp.status, resp.result, resp.values(), resp.closing) == (
        9,
        status,
        result,
        values,
        False,
    )


def test_closing_notice() -> None:
    [(header, payload)] = _frames(encode_closing())
    assert decode_response(header, payload).closing


def _decoded_requests(pieces: list[bytes]) -> list[Request]:
    got: list[Request] = []
    reader = FrameReader(lambda h, n: None, lambda h, p: got.append(decode_request(h, p)))
    for piece in pieces:
        reader.feed(piece)
    return got


def test_requests_split_at_every_offset() -> None:
    data = b"".join(map(_request_frame, REQUESTS))
    for cut in range(len(data) + 1):
        assert _decoded_requests([data[:cut], data[cut:]]) == REQUESTS, f"split at {cut}"


BAD_REQUESTS: dict[str, tuple[Any, bytes]] = {
    "not-a-list": ({"op": "get"}, b""),
    "short": (["get", 1, ["k"], []], b""),
    "unknown-op": (["explode", 1, [], [], None], b""),
    "int-op": ([5, 1, [], [], None], b""),
    "bool-rid": (["num_keys", True, [], [], None], b""),
    "str-rid": (["num_keys", "1", [], [], None], b""),
    "keys-not-list": (["check", 1, "k", [], None], b""),
    "key-not-str": (["check", 1, [b"k"], [], None], b""),
    "lens-not-list": (["set", 1, ["k"], 3, None], b"abc"),
    "negative-len": (["set", 1, ["k"], [-1], None], b""),
    "lens-mismatch": (["set", 1, ["k"], [10], None], b"abc"),
    "wrong-key-count": (["get", 1, ["a", "b"], [], 1.0], b""),
    "wrong-value-count": (["compare_set", 1, ["k"], [1], None], b"a"),
    "multi-set-values-per-key": (["multi_set", 1, ["a", "b"], [1], None], b"a"),
    "argument-where-none": (["check", 1, ["k"], [], 5], b""),
    "float-amount": (["add", 1, ["k"], [], 1.5], b""),
    "bool-amount": (["add", 1, ["k"], [], True], b""),
    "amount-past-int64": (["add", 1, ["k"], [], 1 << 63], b""),
    "negative-timeout": (["wait", 1, ["a"], [], -1.0], b""),
    "str-timeout": (["get", 1, ["a"], [], "1"], b""),
}


@pytest.mark.parametrize(("header", "payload"), BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_every_malformed_request_is_a_protocol_error(header: Any, payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_request(header, memoryview(payload))


BAD_RESPONSES: dict[str, tuple[Any, bytes]] = {
    "not-a-list": ({"rid": 1}, b""),
    "long": ([1, "ok", [], None, None], b""),
    "str-rid": (["1", "ok", [], None], b""),
    "lens-not-list": ([1, "ok", 3, None], b"abc"),
    "negative-len": ([1, "ok", [-1], None], b""),
    "lens-mismatch": ([1, "ok", [4], None], b"abc"),
}


@pytest.mark.parametrize(("header", "payload"), BAD_RESPONSES.values(), ids=BAD_RESPONSES.keys())
def test_every_malformed_response_is_a_protocol_error(header: Any, payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_response(header, memoryview(payload))
