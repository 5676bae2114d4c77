"""Control messages between the ranks' runtimes: data, with pure encoding and decoding.

They travel in control frames (never through the matching engine) and are answered by the
receiving rank's runtime itself, with no call of the user's:

* ``Goodbye``: a rank leaves, and says how (destroy, end of its program, uncaught exception).
* ``StateQuery`` / ``StateReply``: after a collective timed out, its rank asks every member
  where it stands (``GroupState``), to name the ranks that never entered the operation and to
  tell whether the group is still in step.
* ``ResyncProposal``: one rank's part of a ``resync``: its state, under the resync's number.

On the wire each is a list whose first item is its tag; ``decode_control`` checks every
field's type and raises ``ProtocolError`` on anything else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiodist.wire.frames import ProtocolError

__all__ = [
    "ABANDONED",
    "DONE",
    "NOT_STARTED",
    "RUNNING",
    "UNKNOWN",
    "Control",
    "Goodbye",
    "GroupState",
    "ResyncProposal",
    "StateQuery",
    "StateReply",
    "decode_control",
]

# What one rank knows of one collective of a group (``GroupState.outcomes``, ``StateReply.status``).
UNKNOWN = 0  # too old to be remembered
NOT_STARTED = 1  # this rank has not entered it
RUNNING = 2
DONE = 3  # completed here
ABANDONED = 4  # failed or timed out here (its data is discarded)
_STATUSES = (UNKNOWN, NOT_STARTED, RUNNING, DONE, ABANDONED)

MAX_OUTCOMES = 64  # how many recent collectives a state reports
_MAX_TEXT = 2000


def _int(v: Any, what: str) -> int:
    if type(v) is not int:
        raise ProtocolError(f"malformed control message: {what} must be an int")
    return v


def _str(v: Any, what: str) -> str:
    if not isinstance(v, str) or len(v) > _MAX_TEXT:
        raise ProtocolError(f"malformed control message: {what} must be a short string")
    return v


def _status(v: Any) -> int:
    if v not in _STATUSES or type(v) is not int:
        raise ProtocolError("malformed control message: unknown operation status")
    return int(v)


@dataclass(frozen=True, slots=True)
class Goodbye:
    """Why a rank leaves the job.

    Attributes:
        how: "destroy" (destroy_process_group), "exit" (its program ended), "exception" (an
            uncaught exception ends it), "exit_code" (``sys.exit`` with a non-zero code).
        detail: the exception ("ValueError: boom") or the exit code, else "".
        after_loss: the loss of another peer that made it leave, else "".
    """

    how: str = "destroy"
    detail: str = ""
    after_loss: str = ""

    TAG = "bye"

    def encode(self) -> list[Any]:
        return [self.TAG, self.how, self.detail[:_MAX_TEXT], self.after_loss[:_MAX_TEXT]]

    @classmethod
    def decode(cls, body: list[Any]) -> Goodbye:
        if len(body) != 4:
            raise ProtocolError("malformed goodbye")
        return cls(_str(body[1], "how"), _str(body[2], "detail"), _str(body[3], "after_loss"))

    def describe(self, rank: int) -> str:
        """What the peers of ``rank`` are told: "rank 1 exited with an uncaught exception (...)"."""
        if self.how == "exception":
            text = f"rank {rank} exited with an uncaught exception ({self.detail})"
        elif self.how == "exit_code":
            text = f"rank {rank} exited with exit code {self.detail}"
        elif self.how == "exit":
            text = f"rank {rank} exited (its program ended without destroy_process_group)"
        else:
            text = f"rank {rank} has left the job (destroy_process_group)"
        return text + (f" after it lost a peer: {self.after_loss}" if self.after_loss else "")


@dataclass(frozen=True, slots=True)
class GroupState:
    """Where one rank stands in one group.

    Attributes:
        next_seq: the sequence number its next collective on the group will take.
        resyncs: how many resyncs of the group it has completed.
        window_from: the sequence number of ``outcomes[0]``.
        outcomes: the status of each recent collective, from ``window_from`` to ``next_seq - 1``.
    """

    next_seq: int
    resyncs: int
    window_from: int = 0
    outcomes: tuple[int, ...] = ()

    def status(self, seq: int) -> int:
        if seq >= self.next_seq:
            return NOT_STARTED
        i = seq - self.window_from
        return self.outcomes[i] if 0 <= i < len(self.outcomes) else UNKNOWN

    def encode(self) -> list[Any]:
        return [self.next_seq, self.resyncs, self.window_from, list(self.outcomes)]

    @classmethod
    def decode(cls, v: Any) -> GroupState:
        if not isinstance(v, list) or len(v) != 4 or not isinstance(v[3], list) or len(v[3]) > MAX_OUTCOMES:
            raise ProtocolError("malformed group state")
        return cls(
            _int(v[0], "next_seq"),
            _int(v[1], "resyncs"),
            _int(v[2], "window_from"),
            tuple(map(_status, v[3])),
        )


@dataclass(frozen=True, slots=True)
class StateQuery:
    """After ``about`` (named ``about_name``) timed out here: where does each member stand?"""

    gid: int
    query_id: int
    about: int
    about_name: str
    state: GroupState

    TAG = "q"

    def encode(self) -> list[Any]:
        return [self.TAG, self.gid, self.query_id, self.about, self.about_name[:200], self.state.encode()]

    @classmethod
    def decode(cls, body: list[Any]) -> StateQuery:
        if len(body) != 6:
            raise ProtocolError("malformed state query")
        return cls(
            _int(body[1], "gid"),
            _int(body[2], "query_id"),
            _int(body[3], "about"),
            _str(body[4], "about_name"),
            GroupState.decode(body[5]),
        )


@dataclass(frozen=True, slots=True)
class StateReply:
    """The answer to a ``StateQuery``: the operation's ``status`` here when the query came."""

    gid: int
    query_id: int
    about: int
    status: int
    state: GroupState

    TAG = "r"

    def encode(self) -> list[Any]:
        return [self.TAG, self.gid, self.query_id, self.about, self.status, self.state.encode()]

    @classmethod
    def decode(cls, body: list[Any]) -> StateReply:
        if len(body) != 6:
            raise ProtocolError("malformed state reply")
        return cls(
            _int(body[1], "gid"),
            _int(body[2], "query_id"),
            _int(body[3], "about"),
            _status(body[4]),
            GroupState.decode(body[5]),
        )


@dataclass(frozen=True, slots=True)
class ResyncProposal:
    """One rank's part of resync number ``epoch`` of group ``gid``."""

    gid: int
    epoch: int
    state: GroupState

    TAG = "s"

    def encode(self) -> list[Any]:
        return [self.TAG, self.gid, self.epoch, self.state.encode()]

    @classmethod
    def decode(cls, body: list[Any]) -> ResyncProposal:
        if len(body) != 4:
            raise ProtocolError("malformed resync proposal")
        return cls(_int(body[1], "gid"), _int(body[2], "epoch"), GroupState.decode(body[3]))


Control = Goodbye | StateQuery | StateReply | ResyncProposal
_BY_TAG: dict[str, Any] = {c.TAG: c for c in (Goodbye, StateQuery, StateReply, ResyncProposal)}


def decode_control(body: Any) -> Control:
    """The control message a frame carried; ``ProtocolError`` for anything malformed."""
    if not isinstance(body, list) or not body or not isinstance(body[0], str) or body[0] not in _BY_TAG:
        raise ProtocolError("malformed control message")
    msg: Control = _BY_TAG[body[0]].decode(body)
    return msg
