"""The peer messages and DETAIL's slot: round trips, every malformed shape, every split."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodist.wire import handshake as hs
from aiodist.wire.control import (
    ABANDONED,
    DONE,
    RUNNING,
    Goodbye,
    GroupState,
    ResyncProposal,
    StateQuery,
    StateReply,
)
from aiodist.wire.detail import SLOT, decode_slot, encode_slot
from aiodist.wire.frames import FrameReader, ProtocolError, encode_frame
from aiodist.wire.messages import (
    KIND_ABORT,
    KIND_BYE,
    KIND_CTRL,
    KIND_DATA,
    KIND_DATA_PENDING,
    KIND_MISMATCH,
    KIND_VERDICT,
    Abort,
    Bye,
    ControlFrame,
    Data,
    Mismatch,
    PeerMessage,
    ShmFrame,
    Verdict,
    decode,
    encode,
    encode_data,
)

FP = ["all_reduce", 5, "float32", 1024, -1, "SUM"]
P2P_FP = ["send", "int64", 3]
STATE = GroupState(next_seq=9, resyncs=1, window_from=6, outcomes=(DONE, ABANDONED, RUNNING))

# Every message type, with the payload it carries (data only).
MESSAGES: list[tuple[PeerMessage, bytes]] = [
    (Data((3, 0, 17), FP), b"x" * 40),
    (Data((3, 1, 0), P2P_FP), b"y" * 3),
    (Data((0, 2, 4), None), b""),
    (Data((3, 1, 2), P2P_FP, True), b"w" * 50),  # pending: a verdict follows
    (Verdict(True), b""),
    (Verdict(False), b""),
    (Mismatch((3, 0, 17), FP, ["all_reduce", 5, "float32", 1023, -1, "SUM"]), b""),
    (Mismatch((1, 1, 0), None, P2P_FP), b""),
    (Abort((3, 0, 17), "rank 2 closed its connection", "network"), b""),
    (Abort((3, 0, 18), "timed out after 30 s", "timeout"), b""),
    (Bye(Goodbye()), b""),
    (Bye(Goodbye("exception", "ValueError: boom", "rank 1 closed its connection")), b""),
    (ControlFrame(Goodbye("exit")), b""),
    (ControlFrame(StateQuery(3, 7, 12, "all_reduce #12", STATE)), b""),
    (ControlFrame(StateReply(3, 7, 12, DONE, STATE)), b""),
    (ControlFrame(ResyncProposal(3, 2, GroupState(4, 0))), b""),
]


def _frames_of(data: bytes) -> list[tuple[Any, bytes]]:
    got: list[tuple[Any, bytes]] = []
    reader = FrameReader(lambda h, n: None, lambda h, p: got.append((h, bytes(p))))
    assert reader.feed(data) == len(data)
    return got


@pytest.mark.parametrize(("msg", "payload"), MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: PeerMessage, payload: bytes) -> None:
    [(header, body)] = _frames_of(encode(msg, len(payload)) + payload)
    assert decode(header, len(body)) == msg
    assert body == payload


def test_the_bytes_are_the_positional_lists_of_before() -> None:
    """The format is pinned: peers built before the message types read these frames."""
    key = (3, 0, 17)
    assert encode(Data(key, FP), 40) == encode_frame([KIND_DATA, 3, 0, 17, FP], 40)
    assert encode_data(key, FP, 40) == encode(Data(key, FP), 40)
    assert encode(Mismatch(key, FP, None)) == encode_frame([KIND_MISMATCH, 3, 0, 17, [FP, None]])
    assert encode(Abort(key, "why", "timeout")) == encode_frame([KIND_ABORT, 3, 0, 17, ["timeout", "why"]])
    bye = Goodbye("exit_code", "3")
    assert encode(Bye(bye)) == encode_frame([KIND_BYE, 0, 0, 0, ["bye", "exit_code", "3", ""]])
    assert encode(ControlFrame(bye)) == encode_frame([KIND_CTRL, 0, 0, 0, ["bye", "exit_code", "3", ""]])


def test_long_texts_are_cut_to_their_limits() -> None:
    msg = decode(*_only(encode(Abort((0, 0, 0), "r" * 10_000, "k" * 100))))
    assert isinstance(msg, Abort)
    assert (len(msg.reason), len(msg.kind)) == (4000, 32)


def test_only_data_carries_a_payload() -> None:
    with pytest.raises(ValueError, match="carries no payload"):
        encode(Abort((0, 0, 0), "x"), 3)


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ("rank 3 closed its connection", Goodbye(after_loss="rank 3 closed its connection")),
        ("x" * 5000, Goodbye(after_loss="x" * 2000)),
        (None, Goodbye()),
        (["q", 3, 7, 12, "all_reduce #12", STATE.encode()], Goodbye()),  # not a goodbye: the default
    ],
)
def test_goodbyes_of_older_peers(body: Any, said: Goodbye) -> None:
    assert decode([KIND_BYE, 0, 0, 0, body], 0) == Bye(said)


def test_abort_of_an_older_peer_is_a_lost_peer() -> None:
    assert decode([KIND_ABORT, 1, 0, 2, "rank 3 died"], 0) == Abort((1, 0, 2), "rank 3 died", "network")


MALFORMED: dict[str, tuple[Any, int]] = {
    "none": (None, 0),
    "int": (7, 0),
    "dict": ({"kind": 0}, 0),
    "string": ("abcde", 0),
    "short": ([KIND_DATA, 0, 0, 0], 0),
    "long": ([KIND_DATA, 0, 0, 0, None, None], 0),
    "bool-kind": ([False, 0, 0, 0, None], 0),
    "str-gid": ([KIND_DATA, "0", 0, 0, None], 0),
    "float-seq": ([KIND_DATA, 0, 0, 1.0, None], 0),
    "list-chan": ([KIND_DATA, 0, [1], 0, None], 0),
    "bool-gid": ([KIND_DATA, True, 0, 0, None], 0),
    "data-str-fingerprint": ([KIND_DATA, 0, 0, 0, "x"], 0),
    "data-int-fingerprint": ([KIND_DATA, 0, 0, 0, 5], 4),
    "data-map-fingerprint": ([KIND_DATA, 0, 0, 0, {"op": "x"}], 0),
    "mismatch-payload": ([KIND_MISMATCH, 0, 0, 0, [FP, FP]], 3),
    "mismatch-not-a-pair": ([KIND_MISMATCH, 0, 0, 0, [FP]], 0),
    "mismatch-none": ([KIND_MISMATCH, 0, 0, 0, None], 0),
    "mismatch-int-fingerprint": ([KIND_MISMATCH, 0, 0, 0, [5, FP]], 0),
    "mismatch-str-fingerprint": ([KIND_MISMATCH, 0, 0, 0, [FP, "x"]], 0),
    "abort-payload": ([KIND_ABORT, 0, 0, 0, ["network", "x"]], 1),
    "abort-int": ([KIND_ABORT, 0, 0, 0, 5], 0),
    "abort-int-reason": ([KIND_ABORT, 0, 0, 0, ["network", 5]], 0),
    "abort-triple": ([KIND_ABORT, 0, 0, 0, ["network", "x", "y"]], 0),
    "bye-payload": ([KIND_BYE, 0, 0, 0, None], 2),
    "bye-bad-control": ([KIND_BYE, 0, 0, 0, ["bye", "exit"]], 0),
    "bye-unknown-tag": ([KIND_BYE, 0, 0, 0, ["zz"]], 0),
    "bye-int-detail": ([KIND_BYE, 0, 0, 0, ["bye", "exit", 3, ""]], 0),
    "control-payload": ([KIND_CTRL, 0, 0, 0, Goodbye().encode()], 5),
    "control-none": ([KIND_CTRL, 0, 0, 0, None], 0),
    "control-empty": ([KIND_CTRL, 0, 0, 0, []], 0),
    "control-unknown-tag": ([KIND_CTRL, 0, 0, 0, ["nope", 1]], 0),
    "control-short-query": ([KIND_CTRL, 0, 0, 0, ["q", 3, 7]], 0),
    "control-bad-state": ([KIND_CTRL, 0, 0, 0, ["r", 3, 7, 12, DONE, [1, 2, 3]]], 0),
    "control-bad-status": ([KIND_CTRL, 0, 0, 0, ["r", 3, 7, 12, 99, STATE.encode()]], 0),
    "control-long-text": ([KIND_CTRL, 0, 0, 0, ["bye", "x" * 3000, "", ""]], 0),
    "control-many-outcomes": ([KIND_CTRL, 0, 0, 0, ["s", 3, 2, [9, 0, 0, [DONE] * 65]]], 0),
    "verdict-not-bool": ([KIND_VERDICT, 0, 0, 0, 1], 0),
    "verdict-with-payload": ([KIND_VERDICT, 0, 0, 0, True], 4),
    "pending-bad-fingerprint": ([KIND_DATA_PENDING, 1, 1, 0, "x"], 8),
    "unknown-kind": ([99, 0, 0, 0, None], 0),
    "negative-kind": ([-1, 0, 0, 0, None], 0),
}


@pytest.mark.parametrize(("header", "nbytes"), MALFORMED.values(), ids=MALFORMED.keys())
def test_every_malformed_shape_is_a_protocol_error(header: Any, nbytes: int) -> None:
    with pytest.raises(ProtocolError):
        decode(header, nbytes)


_leaves = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
_values = st.recursive(_leaves, lambda kids: st.lists(kids, max_size=6), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from([KIND_DATA, KIND_MISMATCH, KIND_ABORT, KIND_BYE, KIND_CTRL, 5, 6, 7]) | _values,
        min_size=5,
        max_size=5,
    ).map(lambda h: [*h[:1], h[1] if isinstance(h[1], int) else 0, 0, 0, *h[4:]])
    | _values,
    st.integers(0, 3),
)
def test_any_header_decodes_or_is_a_protocol_error(header: Any, nbytes: int) -> None:
    try:
        msg = decode(header, nbytes)
    except ProtocolError:
        return
    assert isinstance(msg, Data | Mismatch | Abort | Bye | ControlFrame | ShmFrame | Verdict)


def _stream() -> bytes:
    return b"".join(encode(m, len(p)) + p for m, p in MESSAGES)


def _decoded(feed_pieces: list[bytes]) -> list[tuple[PeerMessage, bytes]]:
    got: list[tuple[PeerMessage, bytes]] = []
    reader = FrameReader(lambda h, n: None, lambda h, p: got.append((decode(h, p.nbytes), bytes(p))))
    for piece in feed_pieces:
        reader.feed(piece)
    assert not reader.mid_frame
    return got


def test_every_message_type_split_at_every_offset() -> None:
    data = _stream()
    for cut in range(len(data) + 1):
        assert _decoded([data[:cut], data[cut:]]) == MESSAGES, f"split at {cut}"


def test_every_message_type_byte_at_a_time() -> None:
    data = _stream()
    assert _decoded([data[i : i + 1] for i in range(len(data))]) == MESSAGES


def _only(frame: bytes) -> tuple[Any, int]:
    [(header, payload)] = _frames_of(frame)
    return header, len(payload)


# -- the handshake's refusal ------------------------------------------------------------------


def test_a_refusal_reaches_the_connector_with_its_reason() -> None:
    challenge = hs.make_challenge()
    hello = hs.make_hello(challenge, "job", 1, None)
    [(refusal, _)] = _frames_of(encode_frame(hs.Refusal("rank 1 is already connected").pack()))
    with pytest.raises(hs.AuthError, match="refused by peer: rank 1 is already connected"):
        hs.verify_welcome(challenge, hello, refusal, "job", None)
    assert hs.Refusal("x" * 900).pack() == ["refused", "x" * 500]


# -- DETAIL's fingerprint slot ------------------------------------------------------------------


@pytest.mark.parametrize("fp", [FP, P2P_FP, ["barrier", 0, "", 0, -1, None], []])
def test_detail_slot_round_trip(fp: list[Any]) -> None:
    slot = encode_slot(fp)
    assert slot.nbytes == SLOT
    assert decode_slot(slot) == fp
    assert decode_slot(bytes(slot)) == fp


def test_detail_slot_of_no_fingerprint_is_empty() -> None:
    assert decode_slot(encode_slot(None)) == []


def _slot(length: int, body: bytes) -> bytes:
    return (length.to_bytes(2, "little") + body).ljust(SLOT, b"\0")


DETAIL_MALFORMED: dict[str, bytes] = {
    "short": bytes(SLOT - 1),
    "long": bytes(SLOT + 1),
    "empty": bytes(SLOT),
    "length-overruns": _slot(SLOT, b""),
    "garbage": _slot(3, b"\xc1\xc1\xc1"),
    "truncated-list": _slot(2, msgpack.packb(FP)[:2]),
    "int": _slot(1, msgpack.packb(5)),
    "map": _slot(4, msgpack.packb({"a": 1})),
    "string": _slot(2, msgpack.packb("x")),
    "cut-fingerprint": bytes(encode_slot(["x" * 600])),  # longer than a slot: cut when sent
}


@pytest.mark.parametrize("blob", DETAIL_MALFORMED.values(), ids=DETAIL_MALFORMED.keys())
def test_detail_slot_malformed_is_a_protocol_error(blob: bytes) -> None:
    with pytest.raises(ProtocolError, match="malformed DETAIL fingerprint"):
        decode_slot(blob)
