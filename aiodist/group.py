"""``ProcessGroup``: rank maps, the one way an operation runs, timeouts and failure.

A group is a subset of the job's global ranks sharing one transport. Every collective takes
the group's next sequence number, which becomes its message key on every rank (collectives
on a group are matched across ranks by call order, as in torch), and its fingerprint names the
task or thread that started it (``aiodist.runtime.origin``), so that tasks whose calls reach
the group in another order on each rank get a mismatch, never each other's data;
point-to-point messages are keyed by the user's tag. Each started operation is tracked until
it ends, so that a timeout fails that one operation (and abandons its key: stale data
arriving later is dropped) while a lost peer fails them all and breaks the group. After a
collective times out, its rank asks the members where they stand before raising; ranks that
disagree about which collectives ran mark the group out of step until ``resync``
(``aiodist._recovery``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from aiodist import _tensors
from aiodist import work as _work
from aiodist._inflight import InFlight
from aiodist._recovery import StepKeeper
from aiodist._tensors import byte_view
from aiodist.backends.base import IN, OUT, Backend, Gate, Op
from aiodist.backends.native import NATIVE
from aiodist.collectives import select
from aiodist.collectives.context import OpContext
from aiodist.collectives.detail import check_fingerprints
from aiodist.collectives.here import Handoff, HereContext, HereState, drive
from aiodist.collectives.steps import Stepper, Steps
from aiodist.collectives.topology import host_map
from aiodist.errors import (
    CollectiveMismatchError,
    DistError,
    DistNetworkError,
    DistTimeoutError,
    DistTypeError,
    DistValueError,
    GroupOutOfStepError,
    name_ranks,
)
from aiodist.operations import operation_named
from aiodist.ops import dtype_name
from aiodist.runtime import busy_poll as _busy_poll
from aiodist.runtime import origin as _origin
from aiodist.settings import detail_on
from aiodist.transport.base import (
    COLL,
    P2P,
    Fingerprint,
    Key,
    LateMessageError,
    Transport,
    abort_kind,
    describe_fingerprint,
)
from aiodist.wire.control import Control
from aiodist.work import Work

__all__ = ["PEER_LOSS_GRACE", "ProcessGroup"]

#: ``irecv_here``'s receives completed without a wait are let go once this many are held.
_HERE_PRUNE_FROM = 64

log = logging.getLogger("aiodist")

# After a member is lost (no goodbye), operations in flight that do not need it directly get
# this many seconds to complete (the data of a rank that exits right after its last
# operation is already on its way); whatever is still pending then fails, naming the lost
# rank, instead of waiting for the timeout.
PEER_LOSS_GRACE = 1.0

_MIN_TAG, _MAX_TAG = -(2**63), 2**63 - 1


def _describe_ranks(ranks: Sequence[int | None]) -> str:
    names = ["any source" if r is None else str(r) for r in ranks]
    if not names:
        return "no rank (the operation was still sending)"
    return name_ranks(names)


class ProcessGroup:
    """A group of global ranks over one transport.

    Args:
        transport: the job's transport (shared by every group of the job).
        ranks: the group's members as global ranks, in group-rank order.
        gid: the group's id, equal on every rank (keys its messages apart from other groups').
        timeout: seconds every operation may take before it fails with ``DistTimeoutError``.
        backend: the name ``get_backend`` reports.
        runs_on: what runs the group's tensor operations (``aiodist.backends``; default: aiodist's
            algorithms over ``transport``).

    Every operation starts one way: the group checks its arguments (``aiodist.arguments``, asking
    its backend's binding for each tensor), numbers it (collectives), applies DETAIL mode and
    starts it on its backend. Object collectives, ``monitored_barrier`` and DDP's exchanges run
    their own algorithms through ``run_collective``, the same numbering and DETAIL step.
    """

    def __init__(
        self,
        transport: Transport,
        ranks: Sequence[int],
        gid: int,
        *,
        timeout: float,
        backend: str = "tcp",
        name: str = "",
        runs_on: Backend = NATIVE,
        task_check: str = "auto",
    ) -> None:
        self.transport = transport
        self.runs_on = runs_on
        self.loop = transport.loop
        self.ranks: tuple[int, ...] = tuple(ranks)
        self.gid = gid
        self.timeout = timeout
        self.backend = backend
        self.name = name or ("default group" if gid == 0 else f"group {gid}")
        self._group_rank = {g: i for i, g in enumerate(self.ranks)}
        if len(self._group_rank) != len(self.ranks):
            raise DistValueError(f"ranks {list(ranks)} contain duplicates")
        self.rank = self._group_rank.get(transport.rank, -1)
        self.size = len(self.ranks)
        self.global_rank = transport.rank
        self._seq = 0
        # The last large reduction started on this group, and the keys of those waiting for
        # their turn with the name of the one each waits for (see _in_turn).
        self._reduction_tail: Work | None = None
        self._behind: dict[Key, str] = {}
        self.broken: DistError | None = None
        self._inflight: dict[asyncio.Future[Any], InFlight] = {}
        # Receives a blocking caller's thread posted without a hop to the loop (``irecv_here``):
        # in flight as the others are (their deadline, a lost peer, an abort fail them), with
        # no callback on their futures until one is waited for on the loop (``follow_here``).
        # Written from that thread, read here; dict operations are atomic under the GIL.
        self._here_ops: dict[asyncio.Future[Any], InFlight] = {}
        self._here_prune_at = _HERE_PRUNE_FROM
        # One timer for the group, armed at the earliest deadline of the operations in flight
        # (a timer per operation, created and cancelled on every send and receive, cost more
        # than the rest of the bookkeeping of a small message).
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._deadline_at = math.inf
        self._poll = _busy_poll.for_loop(self.loop)
        # Set while the ranks disagree about which collectives ran: collectives raise it until
        # resync (aiodist._recovery). Collectives numbered below _floor were settled by a resync.
        self.out_of_step: GroupOutOfStepError | None = None
        self._floor = 0
        self._keeper = StepKeeper(self)
        # Refusals of messages of sends that had completed, by (receiver, tag): the next send to
        # that receiver with that tag raises it (``on_send_refused``).
        self._refused: dict[tuple[int, int], CollectiveMismatchError] = {}
        # The tasks that started collectives here, and when differing ones are a mismatch.
        self.origins = _origin.OriginBook(task_check)
        # Whether its blocking collectives may run on their callers' threads (``runs_here``:
        # facts of the job, worked out once).
        self._runs_here: bool | None = None
        if self.rank >= 0:
            transport.attach(gid, self)

    def __repr__(self) -> str:
        return f"<ProcessGroup {self.name} ranks={list(self.ranks)} rank={self.rank}>"

    # -- rank maps ----------------------------------------------------------------------
    def group_rank(self, global_rank: int, arg: str = "rank") -> int:
        """The group rank of ``global_rank``; ``DistValueError`` naming ``arg`` if not a member."""
        if not isinstance(global_rank, int) or isinstance(global_rank, bool):
            raise DistTypeError(f"{arg} must be an int global rank, got {type(global_rank).__name__}")
        try:
            return self._group_rank[global_rank]
        except KeyError:
            raise DistValueError(
                f"{arg}={global_rank} is not a member of {self.name} (ranks {list(self.ranks)})"
            ) from None

    def is_member(self) -> bool:
        return self.rank >= 0

    # -- lifecycle / failure ------------------------------------------------------------
    # -- what recovery (``aiodist._recovery``) reads and changes ------------------------------

    @property
    def next_seq(self) -> int:
        """The number this rank's next collective on the group gets."""
        return self._seq

    @property
    def settled_below(self) -> int:
        """Collectives numbered below this were settled by a resync (abandoned where unfinished)."""
        return self._floor

    def in_flight(self) -> list[InFlight]:
        """The group's operations in flight, oldest first (a copy: failing one may end others)."""
        ops = list(self._inflight.values())
        if self._here_ops:
            ops += [op for op in list(self._here_ops.values()) if not op.future.done()]  # type: ignore[union-attr]
        return ops

    def fail_op(self, op: InFlight, err: BaseException) -> None:
        """Fail ``op`` with ``err``, taking back what it still sends or receives."""
        self._fail(op, err)

    def give_up_op(self, op: InFlight, note: str) -> None:
        """Time ``op`` out before its deadline: a member gave up on it (``note`` says which)."""
        self._give_up(op, note)

    def restart_numbering(self, agreed: int) -> None:
        """Number the next collective ``agreed`` (a resync's agreement); below it, settled."""
        self._floor = agreed
        self.transport.mailbox.set_floor(self.gid, agreed)
        self._seq = agreed

    def check_usable(self, what: str) -> None:
        if self.rank < 0:
            raise DistValueError(
                f"{what}: global rank {self.global_rank} is not a member of {self.name} (ranks {list(self.ranks)})"
            )
        if self.broken is not None:
            if isinstance(self.broken, CollectiveMismatchError):  # (ranks disagreed: resync settles it)
                state = f"{self.name} cannot go on until resync on every rank: {self.broken}"
            else:
                state = f"{self.name} is broken: {self.broken}"
            raise type(self.broken)(f"{what} on rank {self.global_rank}: {state}") from self.broken

    def on_control(self, src: int, msg: Control) -> None:
        """A member's state query or resync proposal: the step keeper answers it."""
        self._keeper.on_control(src, msg)

    def on_peer_lost(self, peer: int, exc: DistNetworkError) -> None:
        """A member is gone: the group is broken for every later call.

        An operation in flight fails as soon as it needs the lost rank: at once when it waits
        for that rank's data (the transport fails those receives), when it next sends to it,
        or when another member abandons the operation for the same reason (``_body`` tells
        every member). One that already has all it needs from the lost rank completes, so a
        rank that exits right after the last collective does not fail the others; whatever
        is still pending ``PEER_LOSS_GRACE`` seconds later fails, naming the lost rank.
        """
        if peer not in self._group_rank:
            return
        if self.broken is None:
            self.broken = exc
        self._keeper.on_peer_lost(peer, exc)
        stranded = [op for op in self.in_flight() if op.future is not None and not op.survives_loss]
        if stranded:
            self.loop.call_later(PEER_LOSS_GRACE, self._fail_stranded, stranded, exc)

    def on_peer_gone(self, peer: int, exc: DistNetworkError) -> None:
        """A peer is gone (lost, or left in order): this group's point-to-point operations with
        it fail at once, naming themselves (the transport's error names only the rank)."""
        for op in [op for op in self.in_flight() if op.peer == peer]:
            err = DistNetworkError(f"{op.name} on rank {self.global_rank} failed: {exc}")
            err.__cause__ = exc
            self._fail(op, err)

    def _fail_stranded(self, ops: list[InFlight], exc: DistNetworkError) -> None:
        """Fail the operations that were in flight when a member was lost and are still pending."""
        for op in ops:
            if op.future is not None and not op.future.done():
                err = DistNetworkError(
                    f"{op.name} on rank {self.global_rank} ({self.name}) could not complete "
                    f"within {PEER_LOSS_GRACE:g} s of losing a member: {exc}"
                )
                err.__cause__ = exc
                self._fail(op, err)

    def on_key_failed(self, key: Key, exc: BaseException) -> None:
        if key[1] == COLL and key[2] < self._floor:
            return  # about an operation a resync has settled: stale
        if isinstance(exc, GroupOutOfStepError) and key[1] == COLL:
            # A member found the group out of step and failed this operation: so do we.
            self._keeper.mark_out_of_step(error=exc)
        if isinstance(exc, DistNetworkError) and key[1] == COLL and self.broken is None:
            # Another member abandoned a collective because it lost a peer (its notice
            # names it): this group cannot go on, even before our own connection reports it.
            self.broken = exc
        if isinstance(exc, LateMessageError) and self.broken is None:
            # A collective already returned with data the ranks disagreed about: say so on
            # every later call rather than go on as if nothing happened.
            self.broken = exc
        for op in self.in_flight():
            if op.key == key:
                self._fail(op, exc)

    def on_send_refused(
        self, peer: int, key: Key, fp: Fingerprint | None, exc: CollectiveMismatchError
    ) -> None:
        """``peer`` refused a message of ours (its receive was posted for another size or dtype).

        The send whose message it was fails, if it is still pending: the oldest pending send to
        ``peer`` with that tag and that fingerprint (a peer refuses messages in the order they
        were sent, and sends on a link complete in that order). A send that already completed
        cannot fail after the fact: the next send to ``peer`` with that tag raises the refusal
        instead, before it sends anything (so that the messages still pair one to one with
        the receives), and the refusal is logged now, in case no such send comes.
        """
        if peer not in self._group_rank:
            return
        want = list(fp or ())
        for op in self._inflight.values():  # (oldest first)
            if op.sent is not None and op.key == key and op.sent[0] == peer and list(op.sent[1]) == want:
                if op.future is not None and not op.future.done():
                    err = CollectiveMismatchError(
                        f"{op.name} on rank {self.global_rank}: the receiver refused the message: {exc}"
                    )
                    self._fail(op, err, withdraw=False)  # (the message reached it: nothing to take back)
                    return
                break  # it completed a moment ago (its untracking is yet to run)
        self._refused[(peer, key[2])] = exc
        log.warning(
            "aiodist: rank %d: rank %d refused the message of an earlier send to it (%s): %s; the next "
            "send to rank %d with tag %d raises this error",
            self.global_rank, peer, self.name, exc, peer, key[2],
        )  # fmt: skip

    def _raise_refused(self, peer: int, tag: int) -> None:
        """Raise the refusal of an earlier, completed send to ``peer`` with ``tag``, if one came."""
        exc = self._refused.pop((peer, tag), None)
        if exc is not None:
            raise CollectiveMismatchError(
                f"send to rank {peer} (tag {tag}) on rank {self.global_rank} was not started: the "
                f"message of an earlier send to rank {peer} with this tag was refused: {exc}"
            )

    def abort(self, reason: str = "the process group was destroyed") -> None:
        """Fail every in-flight operation and refuse later ones."""
        if self.broken is None:
            self.broken = DistError(reason)
        for op in self.in_flight():
            self._fail(
                op, DistError(f"{op.name} on rank {self.global_rank}: {reason} while it was in flight")
            )
        self._keeper.close(reason)
        self.transport.detach(self.gid, self)
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer, self._deadline_at = None, math.inf

    # -- operation tracking ---------------------------------------------------------------
    def _track(self, op: InFlight, fut: asyncio.Future[Any], timeout: float | None) -> None:
        op.future = fut
        t = self.timeout if timeout is None else timeout
        if t is not None and t > 0 and t != math.inf:
            op.limit = t
            op.deadline = self.loop.time() + t
        self._adopt(op, fut)

    def _adopt(self, op: InFlight, fut: asyncio.Future[Any]) -> None:
        """Track ``op`` (its future ``fut``, its deadline set) until it ends."""
        self._inflight[fut] = op
        if self._poll.for_ops:  # fixed per loop, so _untrack releases exactly what this held
            self._poll.hold()
        if op.deadline < self._deadline_at:
            self._arm_deadline(op.deadline)
        fut.add_done_callback(self._untrack)

    def _untrack(self, fut: asyncio.Future[Any]) -> None:
        if self._inflight.pop(fut, None) is not None and self._poll.for_ops:
            self._poll.release()

    def _arm_deadline(self, when: float) -> None:
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        self._deadline_timer = self.loop.call_at(when, self._check_deadlines)
        self._deadline_at = when

    def _check_deadlines(self) -> None:
        """Time out every operation past its deadline; re-arm for the next one."""
        self._deadline_timer, self._deadline_at = None, math.inf
        now = self.loop.time()
        soonest = math.inf
        for op in self.in_flight():
            if op.deadline <= now:
                op.deadline = math.inf  # fails once
                self._timed_out(op, op.limit)
            elif op.deadline < soonest:
                soonest = op.deadline
        if soonest < self._deadline_at:
            self._arm_deadline(soonest)

    def _timed_out(self, op: InFlight, t: float) -> None:
        if op.on_timeout is not None:
            self._fail(op, op.on_timeout(t))
            return
        if op.key[1] == COLL and self.size > 1 and not self.transport.closed:
            # Stop taking its data now; raise once the members said where they stand.
            phrase = self._waiting_phrase(op)
            self.transport.abandon(op.key)
            self._keeper.timed_out(op, t, phrase, self.transport.stall_note())
            return
        if op.sent is not None:
            what = (
                f": rank {op.sent[0]} had not taken the message (no receive posted for it, or not "
                "reading); the message is withdrawn, nothing of it is delivered"
            )
        elif waiting := self.transport.mailbox.waiting_on(op.key):
            what = f" waiting for data from {_describe_ranks(waiting)}"
        else:  # (matched: its message was arriving)
            what = " while its message was arriving (the message is kept for the next receive)"
        err = DistTimeoutError(
            f"{op.name} on rank {self.global_rank} ({self.name}) reached its timeout of {t:g} s"
            f"{what}{self.transport.stall_note()}"
        )
        self._fail(op, err)

    def _give_up(self, op: InFlight, note: str) -> None:
        """Time out the collective ``op`` before its deadline: a member gave up on it (``note``)."""
        if op.on_timeout is not None:  # (not one the members exchange about)
            op.deadline = math.inf
            self._fail(op, op.on_timeout(op.limit or self.timeout))
            return
        started = op.deadline - op.limit if op.deadline != math.inf else -math.inf
        op.deadline = math.inf
        phrase = self._waiting_phrase(op)
        self.transport.abandon(op.key)
        self._keeper.timed_out(
            op, op.limit or self.timeout, phrase, self.transport.stall_note(),
            note, self.loop.time() - started,
        )  # fmt: skip

    def _waiting_phrase(self, op: InFlight) -> str:
        """What the collective ``op`` was waiting for, for its timeout's error (" waiting for
        ..."; empty while it was still sending): the ranks whose data it lacked, or the earlier
        reduction whose end it waited for (``_in_turn``)."""
        ahead = self._behind.get(op.key)
        if ahead is not None:
            return (
                f" waiting for its turn: {ahead} had not ended on rank {self.global_rank} "
                "(large reductions of a group run one after another)"
            )
        waiting = self.transport.mailbox.waiting_on(op.key)
        return f" waiting for data from {_describe_ranks(waiting)}" if waiting else ""

    def _fail(self, op: InFlight, err: BaseException, *, withdraw: bool = True) -> None:
        """Fail ``op`` with ``err``; ``withdraw``: take back what it still sends or receives
        first (its cleanup), unless its message was taken already (then it completes)."""
        fut = op.future
        if fut is None or fut.done():
            return
        if withdraw and (op.sent is not None or op.cleanup is not None):
            if op.sent is not None:  # a pending send takes its message back (nothing delivered)
                self.transport.cancel_send(op.sent[0], fut)
            else:
                assert op.cleanup is not None
                op.cleanup()
            if fut.done():  # (a send whose message turned out to be the receiver's already)
                return
        if op.is_task:
            if op.error is None:  # the first cause wins (a mismatch report, then the peer's abort)
                op.error = err
            if op.started:
                fut.cancel()
            # else: cancelling a task that has not run yet would skip ``_body`` altogether (its
            # coroutine would be thrown CancelledError before its first line, the algorithm
            # never awaited, the Work cancelled); its first step raises ``op.error`` instead.
        elif op.stepper is not None:  # (as a task's cancellation: take no more steps, abandon)
            if op.stepper.over:
                return  # its end is being concluded (``_steps_ended``), which decides its outcome
            op.stepper.stop()
            self._abandon(op, err)
            fut.set_exception(err)
        else:
            fut.set_exception(err)

    def start(
        self,
        name: str,
        key: Key,
        coro: Coroutine[Any, Any, Any],
        timeout: float | None = None,
        *,
        survives_loss: bool = False,
    ) -> Work:
        """Run ``coro`` as the operation ``name`` with message key ``key``; return its Work.

        ``survives_loss``: losing a member does not fail this operation after the grace
        period (it handles lost members itself, as monitored_barrier does).
        """
        op = InFlight(name, key)
        op.is_task = True
        op.survives_loss = survives_loss
        task = self.loop.create_task(self._body(op, coro))
        self._track(op, task, timeout)
        return Work(task, name)

    async def _body(self, op: InFlight, coro: Coroutine[Any, Any, Any]) -> Any:
        op.started = True
        if op.error is not None:  # failed before this task first ran (see _fail)
            coro.close()
            self._abandon(op, op.error)
            raise op.error
        try:
            result = await coro
            if op.key[1] == COLL and (late := self._late_data(op)) is not None:
                raise late
            return result
        except asyncio.CancelledError:
            if op.error is None:
                raise
            self._abandon(op, op.error)
            raise op.error from None
        except BaseException as exc:
            err = self._raised(op, exc)
            if err is exc:
                raise
            raise err from exc

    def _raised(self, op: InFlight, exc: BaseException) -> BaseException:
        """``op``'s algorithm raised ``exc``: abandon the operation; return what its Work raises."""
        self._abandon(op, exc)
        if not isinstance(exc, DistNetworkError):
            return exc
        if exc is op.error:  # a member's notice about this operation: it names it already
            if op.key[1] == COLL and self.broken is None:
                self.broken = exc
            return exc
        # Say which operation the loss broke (the transport only knows the rank).
        err = DistNetworkError(f"{op.name} on rank {self.global_rank} failed: {exc}")
        err.__cause__ = exc
        if op.key[1] == COLL and self.broken is None:
            self.broken = err
        return err

    def _late_data(self, op: InFlight) -> CollectiveMismatchError | None:
        """After collective ``op``'s last step: data that no step of it received (its sender ran
        another operation), as the error ``op`` raises."""
        late = self.transport.finish_collective(op.key)
        if late is None:
            return None
        return CollectiveMismatchError(
            f"{op.name} on rank {self.global_rank}: rank {late[0]} sent "
            f"{describe_fingerprint(late[1])}, which no step of it received: the ranks "
            "disagree about the operation (different roots, or different collectives)"
        )

    def run_steps(
        self, ctx: OpContext, steps: Steps, timeout: float | None = None, handoff: Handoff | None = None
    ) -> Work:
        """Run the numbered collective ``ctx`` as ``steps`` (``aiodist.collectives.steps``):
        advanced by its arrivals, with no task; failures, timeouts and the check for late data
        are a task's (``start``). From a blocking caller's thread (a ``HereContext``): run there
        while they complete there (``aiodist.collectives.here``); ``handoff``: on the loop's
        thread, go on from where that thread left them."""
        if type(ctx) is HereContext and not ctx.here.on_loop:
            return self._steps_here(ctx, steps, timeout)
        assert ctx.fp is not None
        name = f"{ctx.fp[0]} #{ctx.fp[1]}"
        op = InFlight(name, ctx.key)
        fut: asyncio.Future[Any] = self.loop.create_future()
        op.stepper = stepper = Stepper(steps, functools.partial(self._steps_ended, op))
        self._track(op, fut, timeout)
        if handoff is None:
            stepper.start()
        elif handoff.error is None:
            stepper.resume(handoff.waits)
        else:
            stepper.stop()
            self._steps_ended(op, handoff.error)
        return Work(fut, name)

    def _steps_here(self, ctx: HereContext, steps: Steps, timeout: float | None) -> Work:
        """On a blocking caller's thread: run ``steps`` there; what they cannot do there goes on
        on the loop's thread from where they stand, tracked there as ``run_steps`` tracks."""
        assert ctx.fp is not None
        name = f"{ctx.fp[0]} #{ctx.fp[1]}"
        handoff = drive(ctx, steps)
        if handoff is None:
            return Work.completed(self.loop, name)

        def take_over() -> Work:  # (on the loop's thread)
            ctx.make_deferred()
            return self.run_steps(ctx, steps, timeout, handoff)

        return self._on_loop(name, take_over)

    def _on_loop(self, name: str, start: Callable[[], Work]) -> Work:
        """From a thread other than the loop's: ``start()`` on the loop's thread; the Work
        returned at once follows the one ``start`` returns there."""
        out: asyncio.Future[Any] = self.loop.create_future()

        def begin() -> None:
            try:
                work = start()
            except BaseException as exc:
                out.set_exception(exc)
                return
            _work.follow(out, _work.take_outcome(work))

        self.loop.call_soon_threadsafe(begin)
        return Work(out, name)

    def runs_here(self) -> bool:
        """Whether a blocking collective on this group may run on its caller's thread
        (``collective(here=...)``): aiodist's own algorithms (no engine of torch's), every
        member on this host reached through shared memory by a transport that serves callers'
        threads, and no DETAIL check (which runs a task first)."""
        ok = self._runs_here
        if ok is None:
            transport = self.transport
            shm = transport.shm_local
            hosts = host_map(transport.host_keys, self.ranks)
            ok = self._runs_here = bool(
                self.size > 1
                and self.rank >= 0
                and transport.serves_here
                and hosts is not None
                and hosts.one_host
                and shm is not None
                and all(shm[r] for r in self.ranks)
            )
        return ok and self.runs_on.own_ops is None and not detail_on()

    def _steps_ended(self, op: InFlight, exc: BaseException | None) -> None:
        fut = op.future
        assert fut is not None
        if fut.done():
            return
        if exc is None:
            exc = self._late_data(op)
            if exc is None:
                fut.set_result(None)
                return
        err = self._raised(op, exc)
        if not fut.done():
            fut.set_exception(err)

    def _abandon(self, op: InFlight, exc: BaseException) -> None:
        """After a failure: drop the operation's stale data and, unless it merely timed out here,
        tell the other members so that none of them waits for data this rank will not send."""
        if op.key[1] != COLL:
            return
        self.transport.abandon(op.key)
        if isinstance(exc, DistTimeoutError | asyncio.CancelledError) or op.survives_loss:
            return  # (a diagnostic such as monitored_barrier tells the members itself)
        reason = f"rank {self.global_rank} abandoned {op.name}: {exc}"
        kind = abort_kind(exc)
        for r in self.ranks:
            if r != self.global_rank and r not in self.transport.dead_peers:
                self.transport.send_abort(r, op.key, reason, kind)

    def _watch(
        self,
        name: str,
        key: Key,
        fut: asyncio.Future[Any],
        timeout: float | None,
        cleanup: Callable[[], object] | None = None,
        *,
        peer: int | None = None,
        sent: tuple[int, Fingerprint] | None = None,
    ) -> Work:
        """Track a plain future (a posted receive, a pending send) as an operation (``peer``: a
        point-to-point operation's; ``sent``: a send's receiver and fingerprint, see ``InFlight``)."""
        if fut.done():
            return Work(fut, name)
        op = InFlight(name, key)
        op.cleanup = cleanup
        op.peer = peer
        op.sent = sent
        self._track(op, fut, timeout)
        return Work(fut, name)

    def track_own(
        self,
        name: str,
        key: Key,
        fut: asyncio.Future[Any],
        timeout: float | None,
        timed_out: Callable[[float], BaseException],
    ) -> Work:
        """Track an operation that the backend's own engine runs (torch's), completed by ``fut``.

        The group's deadline (``timeout``, default the group's) fails it with
        ``timed_out(seconds)``, and nothing more: aiodist's transport never carried it, so there
        is no exchange about where the members stand and nothing to abandon. Losing a member of
        the transport does not fail it either: the engine reports its own peers' failures.
        """
        op = InFlight(name, key)
        op.on_timeout = timed_out
        op.survives_loss = True
        self._track(op, fut, timeout)
        return Work(fut, name)

    # -- point-to-point -------------------------------------------------------------------
    def _peer(self, rank: Any, arg: str, what: str) -> int:
        self.group_rank(rank, arg)
        if rank == self.global_rank:
            raise DistValueError(f"{what}: {arg}={rank} is this process's own rank")
        return int(rank)

    @staticmethod
    def _check_tag(tag: Any) -> int:
        if not isinstance(tag, int) or isinstance(tag, bool):
            raise DistTypeError(f"tag must be an int, got {type(tag).__name__}")
        if not _MIN_TAG <= tag <= _MAX_TAG:
            # (it travels in every message's header as a signed 64-bit integer; a receive that
            # accepted it would wait for a message no send can carry)
            raise DistValueError(f"tag must be a signed 64-bit integer ({_MIN_TAG} to {_MAX_TAG}), got {tag}")
        return tag

    def p2p_args(self, what: str, peer: Any, tag: Any) -> tuple[int | None, int]:
        """The checked peer (a global rank) and tag of a send (``what="send"``) or a receive."""
        if (  # (every message passes here: the common case in one test, the rest below)
            type(peer) is int
            and type(tag) is int
            and self.broken is None
            and self.rank >= 0
            and peer != self.global_rank
            and peer in self._group_rank
            and _MIN_TAG <= tag <= _MAX_TAG
            and not self._refused
        ):
            return peer, tag
        self.check_usable(what)
        if peer is not None:
            peer = self._peer(peer, "dst" if what == "send" else "src", what)
        tag = self._check_tag(tag)
        if self._refused and what == "send":
            self._raise_refused(peer, tag)
        return peer, tag

    def check_p2p(self, what: str, tensor: Any, peer: int | None, tag: int) -> Any:
        """Raise what ``send``/``recv`` would raise for these arguments (any thread).

        Only reads the group, so the sync face calls it from the caller's thread, to raise a
        user's mistake at the call of a non-blocking send or receive. Only for a tensor the
        backend uses directly (``runs_on.direct``).

        Returns:
            The tensor's memory as a numpy array (what the operation may be given instead).
        """
        self.p2p_args(what, peer, tag)
        return _tensors.as_array(tensor, arg="tensor", writable=what != "send")

    def send(self, tensor: Any, dst: int, tag: int = 0, timeout: float | None = None) -> Work:
        """Send ``tensor`` to global rank ``dst``. Completes when ``tensor`` may be reused."""
        peer, tag = self.p2p_args("send", dst, tag)
        assert peer is not None
        runs_on = self.runs_on
        if runs_on.own_ops is None and runs_on.direct(tensor):
            # The common case: the tensor's own memory on the transport, no binding to hold.
            return self._send(_tensors.as_array(tensor, arg="tensor", writable=False), peer, tag, timeout)
        b = runs_on.bind(self, "send")
        try:
            arr = b.tensor(tensor, arg="tensor", role=IN, writable=False)
            b.ready_now()  # a staged input is in host memory before its bytes are queued
        except BaseException:
            b.drop()
            raise
        own = runs_on.own_ops
        if own is not None:  # carried by the backend's engine, not the transport
            return b.complete(own.send(f"send to rank {peer} (tag {tag})", arr, peer, tag, timeout))
        return b.complete(self._send(arr, peer, tag, timeout))

    def _send(self, arr: Any, peer: int, tag: int, timeout: float | None) -> Work:
        name = f"send to rank {peer} (tag {tag})"
        key = (self.gid, P2P, tag)
        fp: Fingerprint = ["send", dtype_name(arr.dtype), arr.size]
        try:
            sent = self.transport.send(peer, key, byte_view(arr), fp)
        except DistError as exc:
            return Work.failed(self.loop, name, exc)
        # Pending: a refusal of its message by the receiver fails it, and a failure (its
        # timeout, destroy) takes its message back (``_fail``), so that a program that sends
        # again does not have it delivered twice (or an older buffer's contents).
        return self._watch(name, key, sent, timeout, peer=peer, sent=(peer, fp))

    def recv(self, tensor: Any, src: int | None = None, tag: int = 0, timeout: float | None = None) -> Work:
        """Receive into ``tensor`` from global rank ``src`` (None: any member). Result: the sender."""
        src, tag = self.p2p_args("recv", src, tag)
        runs_on = self.runs_on
        if runs_on.own_ops is None and runs_on.direct(tensor):
            # The common case: the tensor's own memory on the transport, no binding to hold.
            return self._recv(_tensors.as_array(tensor, arg="tensor", writable=True), src, tag, timeout)
        b = runs_on.bind(self, "recv")
        try:
            arr = b.tensor(tensor, arg="tensor", role=OUT, writable=True)
        except BaseException:
            b.drop()
            raise
        own = runs_on.own_ops
        if own is not None:  # carried by the backend's engine, not the transport
            return b.complete(own.recv(self.recv_name(src, tag), arr, src, tag, timeout))
        return b.complete(self._recv(arr, src, tag, timeout))

    @staticmethod
    def recv_name(src: int | None, tag: int) -> str:
        return f"recv from {'any rank' if src is None else f'rank {src}'} (tag {tag})"

    def _recv(self, arr: Any, src: int | None, tag: int, timeout: float | None) -> Work:
        key = (self.gid, P2P, tag)
        fp: Fingerprint = ["send", dtype_name(arr.dtype), arr.size]
        transport = self.transport
        fut = transport.recv(src, key, byte_view(arr), fp)
        return self._watch(
            self.recv_name(src, tag), key, fut, timeout, cleanup=lambda: transport.cancel_recv(fut), peer=src
        )

    # -- point-to-point on the caller's thread (the blocking face; see transport.shm_here) ---
    def send_here(self, tensor: Any, dst: int, tag: int = 0) -> bool:
        """A blocking send done on the calling thread (not the loop's), where the transport can
        (a small message to a peer of this host): True once sent; False where nothing was sent
        and it must go the loop's way (``send``). Raises what ``send`` raises for bad arguments."""
        runs_on = self.runs_on
        if runs_on.own_ops is not None or not runs_on.direct(tensor):
            return False
        peer, tag = self.p2p_args("send", dst, tag)
        assert peer is not None
        arr = _tensors.as_array(tensor, arg="tensor", writable=False)
        fp: Fingerprint = ["send", dtype_name(arr.dtype), arr.size]
        return self.transport.send_here(peer, (self.gid, P2P, tag), byte_view(arr), fp) is not None

    def recv_here(self, tensor: Any, src: int | None, tag: int, budget: float) -> asyncio.Future[int] | None:
        """A receive done on the calling thread, waiting for its message as the transport's
        ``recv_here`` does: its future (done; or matched and still arriving, which
        ``follow_recv`` then tracks on the loop); None where nothing was posted and it must go
        the loop's way (``recv``). Raises what ``recv`` raises for bad arguments."""
        args = self._recv_args_here(tensor, src, tag)
        return None if args is None else self.transport.recv_here(*args, budget)

    def _recv_args_here(
        self, tensor: Any, src: int | None, tag: int
    ) -> tuple[int, Key, memoryview, Fingerprint] | None:
        """The checked sender, key, buffer and fingerprint of a receive from ``src`` into
        ``tensor`` that the calling thread may post itself; None where it must go the loop's
        way (any source, torch's engine, a tensor to stage). Raises what ``recv`` raises for
        bad arguments."""
        runs_on = self.runs_on
        if src is None or runs_on.own_ops is not None or not runs_on.direct(tensor):
            return None
        peer, tag = self.p2p_args("recv", src, tag)
        assert peer is not None
        arr = _tensors.as_array(tensor, arg="tensor", writable=True)
        fp: Fingerprint = ["send", dtype_name(arr.dtype), arr.size]
        return peer, (self.gid, P2P, tag), byte_view(arr), fp

    def outcome_here(self, fut: asyncio.Future[int], src: int, tag: int) -> int:
        """The sender of a receive done on the calling thread (``recv_here``), or its error: a
        peer lost meanwhile is named as ``on_peer_gone`` names it for a tracked receive."""
        try:
            return fut.result()
        except DistNetworkError as exc:
            raise DistNetworkError(
                f"{self.recv_name(src, tag)} on rank {self.global_rank} failed: {exc}"
            ) from exc

    def received_here(self, fut: asyncio.Future[int], src: int, tag: int) -> Work:
        """The Work of a non-blocking receive that ``recv_here`` completed on the calling thread:
        done, with its sender or its error as ``outcome_here`` gives them."""
        name = self.recv_name(src, tag)
        try:
            return Work.completed(self.loop, name, self.outcome_here(fut, src, tag))
        except Exception as exc:  # (raised by its wait, as the loop's way raises it)
            return Work.failed(self.loop, name, exc)

    def irecv_here(self, tensor: Any, src: int | None, tag: int) -> asyncio.Future[int] | None:
        """A non-blocking receive posted on the calling thread, in line behind the receives
        posted before it, where the transport can (``post_here``): its future, done where its
        message had come; else in flight (``in_flight``: its deadline, a lost peer, an abort
        fail it) with no callback on its future, for ``wait_here_recv`` to wait for on this
        thread or ``follow_here`` on the loop. None where nothing was posted and it must go
        the loop's way (``irecv``). Raises what ``irecv`` raises for bad arguments."""
        args = self._recv_args_here(tensor, src, tag)
        if args is None:
            return None
        peer, key, buf, fp = args
        transport = self.transport
        fut = transport.post_here(peer, key, buf, fp)
        if fut is None or transport.wait_here(peer, key, fut, None):
            return fut
        op = InFlight(self.recv_name(peer, key[2]), key)
        op.future = fut
        op.peer = peer
        op.cleanup = functools.partial(transport.cancel_recv, fut)
        t = self.timeout
        if t is not None and 0 < t < math.inf:
            op.limit = t
            # (the monotonic clock the loop's time follows: read from this thread, uvloop's
            # loop.time() would update the loop's own state)
            op.deadline = time.monotonic() + t
        ops = self._here_ops
        ops[fut] = op
        if len(ops) >= self._here_prune_at:  # (those completed without a wait: polled, dropped)
            for f in [f for f in list(ops) if f.done()]:
                ops.pop(f, None)
            self._here_prune_at = max(_HERE_PRUNE_FROM, 2 * len(ops))
        # Read after the insert: a timer due no later than this deadline checks it when it
        # fires (``_check_deadlines`` looks at these too), else the loop arms one.
        if op.deadline < self._deadline_at:
            self.loop.call_soon_threadsafe(self._arm_for, op.deadline)
        return fut

    def _arm_for(self, deadline: float) -> None:
        """On the loop: have a timer due at ``deadline`` at the latest."""
        if deadline < self._deadline_at:
            self._arm_deadline(deadline)

    def wait_here_recv(self, fut: asyncio.Future[int], budget: float | None) -> bool:
        """Wait on the calling thread for the receive ``irecv_here`` posted, as the transport's
        ``wait_here`` does: True once it is done (no longer in flight here)."""
        op = self._here_ops.get(fut)
        if op is None or op.peer is None:
            return fut.done()
        if not self.transport.wait_here(op.peer, op.key, fut, budget):
            return False
        self._here_ops.pop(fut, None)
        return True

    def follow_here(self, fut: asyncio.Future[int]) -> None:
        """On the loop: track from now, as ``irecv`` tracks its own, the receive ``irecv_here``
        posted, which is to be waited for here (its caller's thread takes it no more)."""
        op = self._here_ops.pop(fut, None)
        if op is not None and not fut.done():
            self._adopt(op, fut)

    def follow_recv(self, fut: asyncio.Future[int], src: int, tag: int, timeout: float | None = None) -> Work:
        """Track, on the loop, a receive ``recv_here`` posted that is still arriving: its
        timeout, a lost peer, as ``recv`` tracks its own."""
        transport = self.transport
        key = (self.gid, P2P, tag)
        return self._watch(
            self.recv_name(src, tag), key, fut, timeout, cleanup=lambda: transport.cancel_recv(fut), peer=src
        )

    def batch_isend_irecv(self, p2p_op_list: Sequence[Any]) -> list[Work] | None:
        """A backend whose engine carries point-to-point operations may start the list itself
        (NCCL coalesces it); None: start them one by one."""
        own = self.runs_on.own_ops
        return None if own is None else own.batch_isend_irecv(p2p_op_list)

    # -- collectives: the one way one starts ------------------------------------------------
    def _number(
        self,
        name: str,
        *,
        dtype: str = "",
        count: int = 0,
        root: int = -1,
        redop: str | None = None,
        allow_broken: bool = False,
        here: float | None = None,
    ) -> OpContext:
        """Take the next sequence number for collective ``name`` and build its context.

        ``root`` is a global rank. ``allow_broken``: run even on a broken group (diagnostics
        such as monitored_barrier, which must still name who is missing). ``here``: the
        context of an operation run on a blocking caller's thread, which waits ``here`` s at
        most for each step there (``collective``).
        """
        if not (allow_broken and self.rank >= 0):
            self.check_usable(name)
            if self.out_of_step is not None:
                raise GroupOutOfStepError(f"{name} on rank {self.global_rank}: {self.out_of_step}")
        seq = self._seq
        self._seq += 1
        key = (self.gid, COLL, seq)
        origin = _origin.current()
        self.origins.note(origin)
        fp = [name, seq, dtype, count, root, redop, origin]
        if here is not None:
            return HereContext(self.transport, self.ranks, self.rank, key, fp, HereState(here))
        return OpContext(self.transport, self.ranks, self.rank, key, fp)

    def _launch(
        self,
        ctx: OpContext,
        start: Callable[[], Work],
        timeout: float | None,
        refused: Callable[[], None] | None = None,
    ) -> Work:
        """``start()`` the numbered collective ``ctx``; with ``AIODIST_DEBUG=DETAIL`` check agreement first.

        The DETAIL check runs before the operation is started, so a disagreement is raised by
        every rank from the same table of fingerprints (no rank's failure notice can overtake
        another rank's own verdict) and the algorithm never starts (``refused`` is called).
        """
        if not detail_on():
            return start()
        t = self.timeout if timeout is None else timeout
        # Shortly before the operation's own deadline, so a rank that never arrives is named.
        check_timeout = t * 0.9 if t and 0 < t < float("inf") else None

        async def checked() -> Any:
            try:
                await check_fingerprints(ctx, check_timeout)
            except BaseException:
                if refused is not None:
                    refused()
                raise
            return await start()

        name = f"{ctx.fp[0]} #{ctx.fp[1]}" if ctx.fp else "collective"
        return Work(self.loop.create_task(checked()), name)

    def collective(
        self, name: str, *args: Any, timeout: float | None = None, here: float | None = None
    ) -> Work:
        """Start the tensor collective ``name`` of the operation table (``aiodist.operations``)
        with the async face's arguments between ``group`` and ``timeout``: check them (with the
        backend's binding of the call), number the call, start it on the backend.

        ``here``: called from a blocking caller's thread (not the loop's) where ``runs_here``
        said it may, with that thread's poll budget: the operation runs there while its steps
        complete there, each polling ``here`` s, then sleeping a while (``shm_here.wait_here``;
        ``aiodist.collectives.here``), and on the loop's thread from wherever they stop."""
        check = operation_named(name).check
        self.check_usable(name)
        b = self.runs_on.bind(self, name)
        try:
            c = check(self, b, *args)
            op = c.op
            root = self.ranks[op.root] if op.root >= 0 else -1
            redop = op.reduce_op.name if op.reduce_op is not None else None
            ctx = self._number(name, dtype=c.dtype, count=c.numel, root=root, redop=redop, here=here)
        except BaseException:
            b.drop()
            raise
        in_turn = self._takes_turns(ctx, op)
        gate = self._in_turn(ctx.key) if in_turn else None
        if not detail_on():  # (the common path: no closure)
            try:
                work = b.start(ctx, op, timeout, gate)
            except (DistTypeError, DistValueError):
                # The backend cannot run this checked call (torch's engine: e.g. PRODUCT on
                # complex tensors) and started nothing: refused, its number given back.
                self._seq -= 1
                b.drop()
                raise
            if self.runs_on.own_ops is not None and self.size > 1:
                work = self._checked_alongside(ctx, work, timeout)
        else:
            work = self._launch(ctx, lambda: b.start(ctx, op, timeout, gate), timeout, b.drop)
        if in_turn:
            self._reduction_tail = work
        return work

    def _checked_alongside(self, ctx: OpContext, work: Work, timeout: float | None) -> Work:
        """``work``, a collective that torch's engine carries (nccl, torch-gloo), whose data no
        fingerprint travels with: the members exchange fingerprints over the group's transport
        while it runs (n - 1 small messages each), and the Work raises their disagreement
        (``CollectiveMismatchError``: e.g. tasks sharing the group that called in another order
        on each rank) instead of returning what the engine exchanged."""
        # The engine's own timeout comes first (its error says what it waited for); the check's
        # bounds it only where the engine completed and some member's fingerprint never came.
        t = self.timeout if timeout is None else timeout
        check_timeout = t + PEER_LOSS_GRACE if t and 0 < t < math.inf else None
        check = self.loop.create_task(check_fingerprints(ctx, check_timeout, what="fingerprint check"))
        engine = _work.future_of(work)

        async def checked() -> Any:
            try:
                await asyncio.wait((engine, check), return_when=asyncio.FIRST_EXCEPTION)
                if check.done():
                    check.result()  # the members disagree, or some never reached it
                result = await work
                await check
                return result
            except BaseException:
                # The engine's outcome is not wanted any more (nor reported as never retrieved);
                # a check still running is stopped (one that ended was read above).
                _work.discard(work)
                check.cancel()
                raise

        return Work(self.loop.create_task(checked()), work.name)

    def _takes_turns(self, ctx: OpContext, op: Op) -> bool:
        """Whether ``op`` is a reduction large enough to wait for the group's previous one
        (``select.IN_TURN_BYTES``, among ranks reaching each other through shared memory)."""
        if op.reduce_op is None or self.runs_on.own_ops is not None or self.size < 2:
            return False
        nbytes = max(sum(a.nbytes for a in op.outputs), sum(a.nbytes for a in op.inputs))
        return nbytes >= select.IN_TURN_BYTES and ctx.shares_memory()

    def _in_turn(self, key: Key) -> Gate | None:
        """A gate that opens once the group's previous large reduction has ended (any outcome).

        Large reductions over shared memory run one after another in the order of their
        numbers, as a stream orders NCCL's kernels (see ``select.IN_TURN_BYTES`` for why). The
        numbers are equal on every rank and each reduction waits only for a lower one, so the
        waits cannot form a cycle between ranks; the caller is never blocked (the Work is
        returned at once, and its timeout counts from the call).
        """
        prev = self._reduction_tail
        if (
            prev is None or _work.future_of(prev).done()
        ):  # (not is_completed: the caller's Work is not ours to note)
            return None
        behind = self._behind

        async def previous_ended() -> None:
            behind[key] = prev.name
            try:
                await asyncio.wait((_work.future_of(prev),))
            finally:
                del behind[key]

        return previous_ended

    def run_collective(
        self,
        name: str,
        algorithm: Callable[[OpContext], Coroutine[Any, Any, Any]],
        timeout: float | None = None,
        *,
        dtype: str = "",
        count: int = 0,
        root: int = -1,
        allow_broken: bool = False,
        survives_loss: bool = False,
    ) -> Work:
        """Number the collective ``name``, apply DETAIL mode and run ``algorithm(ctx)`` on this
        group's transport (object collectives, monitored_barrier, DDP's exchanges).

        ``root`` is a global rank. ``allow_broken``: a diagnostic that runs on a broken group
        (it skips the DETAIL check, which needs every member). ``survives_loss``: losing a
        member does not fail it after the grace period (it reports lost members itself).
        """
        ctx = self._number(name, dtype=dtype, count=count, root=root, allow_broken=allow_broken)

        def start() -> Work:
            return self.track_collective(ctx, algorithm(ctx), timeout, survives_loss=survives_loss)

        return start() if allow_broken else self._launch(ctx, start, timeout)

    def track_collective(
        self,
        ctx: OpContext,
        coro: Coroutine[Any, Any, Any],
        timeout: float | None = None,
        *,
        survives_loss: bool = False,
    ) -> Work:
        """Run the algorithm ``coro`` of the numbered collective ``ctx`` (a backend's last step)."""
        assert ctx.fp is not None
        if type(ctx) is HereContext and not ctx.here.on_loop:  # (from a caller's thread: a
            # task is the loop's to make, and its sends and receives the loop's to make too)
            ctx.here.on_loop = True
            return self._on_loop(
                ctx.fp[0], lambda: self.track_collective(ctx, coro, timeout, survives_loss=survives_loss)
            )
        return self.start(f"{ctx.fp[0]} #{ctx.fp[1]}", ctx.key, coro, timeout, survives_loss=survives_loss)

    def resync(self, timeout: float | None = None) -> Work:
        """Bring the group back in step after a timeout or a disagreement (see ``aiodist.resync``)."""
        return self._keeper.resync(timeout)
