"""After a timeout: name who never entered the operation, keep the group in step, ``resync``.

Collectives on a group are matched across ranks by their sequence number, so after a
timeout the ranks must agree on which operations happened. When a collective times out on a
rank, that rank asks every member where it stands (a ``StateQuery``, answered by the member's
runtime, no user call needed) and waits a bounded moment (at most ``min(1 s, T/2)``) before
raising: the ``DistTimeoutError`` then names the ranks that never entered the operation and
those that did not answer. The same exchange decides whether the group is still in step:

* every member abandoned the operation, or is still running it (a slow rank, which fails it
  at once when the query arrives): the group goes on, in step;
* a member never entered it, or had completed it: the ranks disagree about which operations
  happened. Every rank that learns it (the querier from the reply, the member from the query,
  the others through the abort notices of the operations this fails) marks the group out of
  step: its collectives raise ``GroupOutOfStepError`` at once until ``resync``.

``resync`` is a collective of its own, matched by its own counter (the number of resyncs of
the group), not by operation numbers, which may disagree: every member sends its state (next
operation number, the outcome of its recent operations); once a rank has every member's, it
fails whatever collective is still in flight, moves its operation counter to the largest
proposed (messages of older operations are discarded from then on) and returns a report of
which recent operations completed on which ranks (ULFM's agreement is the model). A member's
proposal reaching a rank that has not called resync marks that rank out of step, so a rank
that never saw an error is stopped at its next collective instead of waiting on the others.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from aiodist._inflight import InFlight
from aiodist.errors import (
    DistError,
    DistNetworkError,
    DistTimeoutError,
    DistValueError,
    GroupOutOfStepError,
    name_ranks,
)
from aiodist.transport.base import COLL
from aiodist.wire.control import (
    ABANDONED,
    DONE,
    MAX_OUTCOMES,
    NOT_STARTED,
    RUNNING,
    UNKNOWN,
    Control,
    GroupState,
    ResyncProposal,
    StateQuery,
    StateReply,
)
from aiodist.work import Work

if TYPE_CHECKING:
    from aiodist.transport.base import Transport

__all__ = ["Recoverable", "ResyncReport", "StepKeeper"]

# The longest a rank waits for the members' answers after a timeout.
MAX_QUERY_WAIT = 1.0
# Queries remembered after their answer window (a late answer still tells the group is out of step).
_QUERIES_KEPT = 64


def _ranks(ranks: Iterable[int]) -> str:
    return name_ranks(sorted(ranks))


def _at(next_seq: int) -> str:
    return f"#{next_seq - 1}" if next_seq > 0 else "no operation yet"


def positions(next_seqs: dict[int, int]) -> str:
    """ "rank 2 at operation #6, ranks 0, 1 at #7": where each rank is (its latest collective)."""
    by_seq: dict[int, list[int]] = {}
    for rank, n in next_seqs.items():
        by_seq.setdefault(n, []).append(rank)
    parts = [f"{_ranks(rs)} at {_at(n)}" for n, rs in sorted(by_seq.items())]
    if parts:
        parts[0] = parts[0].replace(" at #", " at operation #", 1)
    return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class ResyncReport:
    """What ``resync`` agreed on, the same on every rank (``discarded`` is this rank's own).

    Attributes:
        group: the group's name.
        resync: the resync's number on this group (1 for the first).
        next_op: the sequence number every rank's next collective on the group takes.
        ranks_at: each member's (global rank's) next operation number before the resync.
        completed: for each recent operation number, the members that completed it; an
            operation some members completed and others did not is in ``disagreed``.
        discarded: this rank's operations that were still in flight and failed by the resync.
    """

    group: str
    resync: int
    next_op: int
    ranks_at: dict[int, int]
    completed: dict[int, tuple[int, ...]] = field(default_factory=dict)
    discarded: tuple[str, ...] = ()

    @property
    def disagreed(self) -> tuple[int, ...]:
        """Operation numbers that completed on some members but not on all (their results differ)."""
        n = len(self.ranks_at)
        return tuple(seq for seq, rs in sorted(self.completed.items()) if 0 < len(rs) < n)

    def __str__(self) -> str:
        text = f"resync #{self.resync} of {self.group}: next operation #{self.next_op}"
        text += f" (before: {positions(self.ranks_at)})"
        for seq in self.disagreed:
            text += f"; operation #{seq} completed only on {_ranks(self.completed[seq])}"
        if self.discarded:
            text += f"; discarded here: {', '.join(self.discarded)}"
        return text


class Recoverable(Protocol):
    """A group as recovery sees it (``aiodist.group.ProcessGroup`` is one): its members, its
    numbering and its operations in flight, read and changed only through these."""

    loop: asyncio.AbstractEventLoop
    transport: Transport
    gid: int
    name: str
    timeout: float
    rank: int
    global_rank: int
    ranks: tuple[int, ...]
    broken: DistError | None
    out_of_step: GroupOutOfStepError | None

    @property
    def next_seq(self) -> int: ...

    @property
    def settled_below(self) -> int: ...

    def in_flight(self) -> list[InFlight]: ...

    def fail_op(self, op: InFlight, err: BaseException) -> None: ...

    def give_up_op(self, op: InFlight, note: str) -> None: ...

    def restart_numbering(self, agreed: int) -> None: ...


@dataclass(slots=True)
class _Query:
    """A state query this rank sent after ``op`` timed out."""

    op: InFlight
    limit: float
    waiting: str
    stall: str
    note: str
    elapsed: float
    window: float
    pending: set[int]
    replies: dict[int, tuple[int, GroupState]] = field(default_factory=dict)
    timer: asyncio.TimerHandle | None = None
    concluded: bool = False


@dataclass(slots=True)
class _Resync:
    epoch: int
    name: str
    limit: float
    future: asyncio.Future[Any]
    discarded: tuple[str, ...]
    timer: asyncio.TimerHandle | None = None


class StepKeeper:
    """A group's state exchange after timeouts, its out-of-step marking, and its resync."""

    def __init__(self, group: Recoverable) -> None:
        self.group = group
        self.resyncs = 0  # resyncs completed on this group
        self._next_qid = 0
        self._queries: dict[int, _Query] = {}
        self._proposals: dict[int, dict[int, GroupState]] = {}  # epoch -> global rank -> state
        self._mine: dict[int, GroupState] = {}  # our own proposal per epoch (re-sent unchanged)
        self._resync: _Resync | None = None

    # -- this rank's state ----------------------------------------------------------------
    def status(self, seq: int, running: set[int] | None = None) -> int:
        """What this rank knows of its collective ``seq`` (``running``: the in-flight ones, if
        already collected)."""
        g = self.group
        if seq >= g.next_seq:
            return NOT_STARTED
        key = (g.gid, COLL, seq)
        mailbox = g.transport.mailbox
        if mailbox.was_abandoned(key) or seq < g.settled_below:
            return ABANDONED
        if mailbox.was_finished(key):
            return DONE
        if seq in (self._running() if running is None else running):
            return RUNNING
        return UNKNOWN

    def snapshot(self) -> GroupState:
        n = self.group.next_seq
        start = max(0, n - MAX_OUTCOMES)
        running = self._running()
        return GroupState(n, self.resyncs, start, tuple(self.status(s, running) for s in range(start, n)))

    def _running(self) -> set[int]:
        g = self.group
        return {
            op.key[2]
            for op in g.in_flight()
            if op.key[0] == g.gid and op.key[1] == COLL and op.future is not None and not op.future.done()
        }

    def _op(self, seq: int) -> InFlight | None:
        g = self.group
        key = (g.gid, COLL, seq)
        for op in g.in_flight():
            if op.key == key and op.future is not None and not op.future.done():
                return op
        return None

    def _members(self) -> list[int]:
        g = self.group
        return [r for r in g.ranks if r != g.global_rank and r not in g.transport.dead_peers]

    # -- after a timeout ------------------------------------------------------------------
    def timed_out(
        self, op: InFlight, limit: float, waiting: str, stall: str, note: str = "", elapsed: float = math.inf
    ) -> None:
        """``op`` (a collective, already abandoned here) timed out, after ``elapsed`` seconds
        (``note``: why before its own deadline; ``waiting``: " waiting for ..." or empty, as
        the error says it): ask every member where it stands, then fail it with what they said."""
        g = self.group
        members = self._members()
        qid = self._next_qid
        self._next_qid += 1
        q = _Query(op, limit, waiting, stall, note, elapsed, min(MAX_QUERY_WAIT, limit / 2), set(members))
        self._queries[qid] = q
        for old in [k for k, v in self._queries.items() if v.concluded and k <= qid - _QUERIES_KEPT]:
            self._forget(old)  # (one still waiting for answers is kept: its operation must fail)
        msg = StateQuery(g.gid, qid, op.key[2], op.name, self.snapshot())
        for r in members:
            g.transport.send_control(r, msg)
        if members:
            q.timer = g.loop.call_later(q.window, self._conclude, qid)
        else:
            self._conclude(qid)

    def _forget(self, qid: int) -> None:
        q = self._queries.pop(qid, None)
        if q is not None and q.timer is not None:
            q.timer.cancel()

    def _conclude(self, qid: int) -> None:
        q = self._queries.get(qid)
        if q is None or q.concluded:
            return
        q.concluded = True
        if q.timer is not None:
            q.timer.cancel()
            q.timer = None
        g = self.group
        op = q.op
        never = {r: st for r, (status, st) in q.replies.items() if status == NOT_STARTED}
        done = [r for r, (status, _) in q.replies.items() if status == DONE]
        parts = []
        if never:
            if len(never) == 1:
                (n,) = (st.next_seq for st in never.values())
                where = (
                    f"it is at operation #{n - 1}" if n else "it has started no operation on the group yet"
                )
            else:
                where = ", ".join(f"rank {r} is at {_at(st.next_seq)}" for r, st in sorted(never.items()))
            parts.append(f"{_ranks(never)} never entered it ({where})")
        if done:
            parts.append(f"{_ranks(done)} had completed it")
        if q.pending:
            parts.append(f"{_ranks(q.pending)} did not answer within {q.window:g} s (stopped or overloaded)")
        if not parts:
            parts.append("every rank entered it")
        me = f"{op.name} on rank {g.global_rank} ({g.name})"
        if not q.note or (q.limit < math.inf and q.elapsed >= 0.9 * q.limit):
            note = f" ({q.note})" if q.note else ""
            text = f"{me} reached its timeout of {q.limit:g} s{q.waiting}{q.stall}{note}: {'; '.join(parts)}"
        else:  # a member gave up on it first, before this rank's own deadline (if any)
            after = f" after {q.elapsed:.2g} s" if q.elapsed < math.inf else ""
            text = f"{me} was abandoned{after} here{q.waiting}{q.stall}: {q.note}; {'; '.join(parts)}"
        detail = ""
        if never or done:
            at = {r: st.next_seq for r, (_, st) in q.replies.items()}
            at[g.global_rank] = g.next_seq
            what = "never entered" if never else "had completed"
            detail = (
                f"{_ranks(never or done)} {what} {op.name}, which rank {g.global_rank} abandoned "
                f"({positions(at)})"
            )
            if g.out_of_step is None:
                text += f"; {g.name} is now out of step: call resync on every rank, then go on"
        g.fail_op(op, DistTimeoutError(text))
        if detail:
            self.mark_out_of_step(detail)

    def on_control(self, src: int, msg: Control) -> None:
        """A control message of this group from ``src`` (called by the transport)."""
        if isinstance(msg, StateQuery):
            self._on_query(src, msg)
        elif isinstance(msg, StateReply):
            self._on_reply(src, msg)
        elif isinstance(msg, ResyncProposal):
            self._on_proposal(src, msg)

    def _on_query(self, src: int, q: StateQuery) -> None:
        g = self.group
        if q.state.resyncs != self.resyncs or src not in g.ranks:
            return  # from before a resync (ours or its): stale
        status = self.status(q.about)
        if status == RUNNING:
            op = self._op(q.about)
            if op is not None:
                # It cannot complete (src no longer takes part): give up on it now, as src did,
                # rather than at our own deadline, so that both ranks go on to the next
                # operation together; our error names who never entered it, as src's does.
                g.give_up_op(op, f"rank {src} reached its time limit in it first")
        elif status in (NOT_STARTED, DONE):
            what = "never entered" if status == NOT_STARTED else "had completed"
            at = {src: q.state.next_seq, g.global_rank: g.next_seq}
            self.mark_out_of_step(
                f"rank {src} abandoned {q.about_name} after its timeout, which rank {g.global_rank} "
                f"{what} ({positions(at)})"
            )
        g.transport.send_control(src, StateReply(g.gid, q.query_id, q.about, status, self.snapshot()))

    def _on_reply(self, src: int, r: StateReply) -> None:
        if r.state.resyncs != self.resyncs:
            return
        q = self._queries.get(r.query_id)
        if q is not None and not q.concluded and src in q.pending:
            q.pending.discard(src)
            q.replies[src] = (r.status, r.state)
            if not q.pending:
                self._conclude(r.query_id)
            return
        if r.status in (NOT_STARTED, DONE):  # an answer after the window: still a disagreement
            g = self.group
            name = q.op.name if q is not None else f"collective #{r.about}"
            what = "never entered" if r.status == NOT_STARTED else "had completed"
            at = {src: r.state.next_seq, g.global_rank: g.next_seq}
            self.mark_out_of_step(
                f"rank {src} {what} {name}, which rank {g.global_rank} abandoned ({positions(at)})"
            )

    # -- out of step --------------------------------------------------------------------
    def mark_out_of_step(self, detail: str = "", error: GroupOutOfStepError | None = None) -> None:
        """The ranks disagree about which operations ran (``detail``, or a member's ``error``
        saying so): refuse collectives until resync, and fail those in flight (their abort
        notices tell the members they involve)."""
        g = self.group
        if g.out_of_step is None:
            g.out_of_step = error or GroupOutOfStepError(
                f"{g.name} is out of step: {detail}; call resync on every rank "
                "(aiodist.resync or aiodist.sync.resync), then go on"
            )
        # (an operation that timed out here is left to raise its own error, which names who
        # never entered it, at the end of its exchange)
        self.fail_in_flight(lambda op: f"{op.name} on rank {g.global_rank}: {g.out_of_step}", timed_out=False)

    def fail_in_flight(self, why: Any, *, timed_out: bool = True) -> list[str]:
        """Fail this group's collectives in flight with ``GroupOutOfStepError(why(op))``
        (``timed_out``: also those that timed out here and wait for the members' answers)."""
        g = self.group
        names = []
        for op in g.in_flight():
            if op.key[1] == COLL and op.future is not None and not op.future.done():
                if not timed_out and g.transport.mailbox.was_abandoned(op.key):
                    continue
                names.append(op.name)
                g.transport.abandon(op.key)
                g.fail_op(op, GroupOutOfStepError(why(op)))
        return names

    # -- resync -------------------------------------------------------------------------
    def resync(self, timeout: float | None) -> Work:
        g = self.group
        epoch = self.resyncs + 1
        name = f"resync #{epoch}"
        if g.rank < 0:
            raise DistValueError(
                f"resync: global rank {g.global_rank} is not a member of {g.name} (ranks {list(g.ranks)})"
            )
        if self._resync is not None:
            raise DistValueError(f"resync of {g.name} called on rank {g.global_rank} while one is running")
        if isinstance(g.broken, DistNetworkError):
            err = type(g.broken)(
                f"{name} on rank {g.global_rank}: {g.name} cannot be brought back in step: {g.broken} "
                "(destroy the process group and init again)"
            )
            return Work.failed(g.loop, name, err)
        gone = [r for r in g.ranks if r in g.transport.dead_peers]
        if gone:
            cause = g.transport.dead_peers[gone[0]]
            return Work.failed(
                g.loop,
                name,
                DistNetworkError(f"{name} on rank {g.global_rank}: {_ranks(gone)} left the job: {cause}"),
            )
        if g.out_of_step is None:
            g.out_of_step = GroupOutOfStepError(f"{g.name} is being brought back in step ({name} is running)")
        discarded = self.fail_in_flight(
            lambda op: f"{op.name} on rank {g.global_rank}: discarded by {name} of {g.name}"
        )
        state = self._mine.setdefault(epoch, self.snapshot())
        self._proposals.setdefault(epoch, {})[g.global_rank] = state
        msg = ResyncProposal(g.gid, epoch, state)
        for r in self._members():
            g.transport.send_control(r, msg)
        t = g.timeout if timeout is None else float(timeout)
        rs = _Resync(epoch, name, t, g.loop.create_future(), tuple(discarded))
        if 0 < t < math.inf:
            rs.timer = g.loop.call_later(t, self._resync_timed_out, rs)
        self._resync = rs
        self._check_resync()
        return Work(rs.future, name)

    def _on_proposal(self, src: int, p: ResyncProposal) -> None:
        if p.epoch <= self.resyncs or src not in self.group.ranks:
            return  # a resync this rank already completed (a member's retry): stale
        self._proposals.setdefault(p.epoch, {})[src] = p.state
        rs = self._resync
        if rs is not None and rs.epoch == p.epoch:
            self._check_resync()
        elif rs is None:
            self.mark_out_of_step(f"rank {src} called resync #{p.epoch} to bring it back in step")

    def _check_resync(self) -> None:
        rs = self._resync
        g = self.group
        if rs is None:
            return
        props = self._proposals.get(rs.epoch, {})
        if any(r not in props for r in g.ranks):
            return
        agreed = max(st.next_seq for st in props.values())
        g.restart_numbering(agreed)
        self.resyncs = rs.epoch
        g.out_of_step = None
        if g.broken is not None and not isinstance(g.broken, DistNetworkError):
            g.broken = None  # a disagreement that broke the group is settled by the agreement
        for e in [e for e in self._proposals if e <= rs.epoch]:
            del self._proposals[e]
        for e in [e for e in self._mine if e <= rs.epoch]:
            del self._mine[e]
        for qid in list(self._queries):
            self._forget(qid)
        report = ResyncReport(
            g.name,
            rs.epoch,
            agreed,
            {r: props[r].next_seq for r in g.ranks},
            _completed(props, g.ranks),
            rs.discarded,
        )
        self._end_resync(rs)
        rs.future.set_result(report)

    def _end_resync(self, rs: _Resync) -> None:
        if rs.timer is not None:
            rs.timer.cancel()
        if self._resync is rs:
            self._resync = None

    def _resync_timed_out(self, rs: _Resync) -> None:
        if rs.future.done():
            return
        g = self.group
        props = self._proposals.get(rs.epoch, {})
        missing = [r for r in g.ranks if r not in props]
        g.out_of_step = GroupOutOfStepError(
            f"{g.name} is out of step: {rs.name} did not complete ({_ranks(missing)} did not call it); "
            "call resync on every rank"
        )
        self._end_resync(rs)
        rs.future.set_exception(
            DistTimeoutError(
                f"{rs.name} on rank {g.global_rank} ({g.name}) reached its timeout of {rs.limit:g} s: "
                f"{_ranks(missing)} did not call resync; call it again on every rank"
            )
        )

    # -- lifetime -----------------------------------------------------------------------
    def on_peer_lost(self, peer: int, exc: DistNetworkError) -> None:
        rs = self._resync
        if rs is not None and not rs.future.done():
            self._end_resync(rs)
            err = DistNetworkError(f"{rs.name} on rank {self.group.global_rank} failed: {exc}")
            err.__cause__ = exc
            rs.future.set_exception(err)

    def close(self, reason: str) -> None:
        for qid in list(self._queries):
            self._forget(qid)
        rs = self._resync
        if rs is not None and not rs.future.done():
            self._end_resync(rs)
            rs.future.set_exception(DistError(f"{rs.name} on rank {self.group.global_rank}: {reason}"))


def _completed(props: dict[int, GroupState], ranks: Sequence[int]) -> dict[int, tuple[int, ...]]:
    """For each operation in every member's recent window: the members that completed it."""
    if not props:
        return {}
    lo = max(st.window_from for st in props.values())
    hi = max(st.next_seq for st in props.values())
    out: dict[int, tuple[int, ...]] = {}
    for seq in range(lo, hi):
        out[seq] = tuple(r for r in ranks if props[r].status(seq) == DONE)
    return out
