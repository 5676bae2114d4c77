"""The seam between a process group and what runs its tensor operations: ``Backend``.

A ``ProcessGroup`` is given its backend when it is created and holds it for life. Every tensor
operation then starts one way (``ProcessGroup``): the group checks the arguments, numbers the
operation, applies DETAIL mode and starts it on its backend. The backend is asked twice:

1. ``bind(group, what)`` -> a ``Binding``: the one operation's view of its tensors while the
   group checks them. ``Binding.tensor`` turns each tensor argument into the flat host array
   the checks (and the algorithms) see: the tensor's own memory (native), or a host twin of a
   device tensor (staged). Whatever a binding took is given back by ``drop`` if the call is
   refused, or by the Work its ``start`` / ``complete`` returns.
2. ``Binding.start(ctx, op, timeout, gate)``: run the checked, numbered collective ``op``
   (``Op``: data, no behaviour) and return its Work; ``gate`` is awaited before the operation
   reads its inputs. Point-to-point operations are queued by the group on the transport;
   ``ready_now`` (before a send is queued) and ``complete`` (after) are the binding's part.

Which algorithm runs a collective is the native backend's choice, in one place
(``aiodist.backends.native.algorithm``): a host-aware or hierarchical selection (shared memory
among the ranks of one host, leaders across hosts) replaces that function, nothing else.

What a timeout does is the backend's choice, by the group method that tracks its operation:
``ProcessGroup.track_collective`` (aiodist's algorithms: the members then exchange where they
stand, see ``aiodist._recovery``) or ``ProcessGroup.track_own`` (an engine of its own: a plain
``DistTimeoutError``; the transport never carried the operation).

Backends: ``NativeBackend`` (aiodist's algorithms over the group's transport), ``StagedBackend``
(wraps another: device tensors through pinned host buffers) and the torch engine
(``aiodist.backends.torch_engine``: torch's ProcessGroupNCCL/Gloo), which runs the checked ``Op``
on torch's engine and carries point-to-point operations there too (``own_ops``).
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from aiodist.ops import ReduceOp
from aiodist.work import Work

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable, Coroutine

    from aiodist.collectives.context import OpContext
    from aiodist.collectives.steps import Steps
    from aiodist.wire.messages import Key

__all__ = [
    "IN",
    "INOUT",
    "OUT",
    "Backend",
    "Binding",
    "BoundGroup",
    "Gate",
    "Op",
    "OpKind",
    "Role",
    "TensorOps",
]

Array = Any  # a flat numpy view (see aiodist._tensors.as_array)


class Role(enum.Enum):
    """How an operation uses a tensor argument: read, written, or both."""

    IN = "in"
    OUT = "out"
    INOUT = "inout"


IN, OUT, INOUT = Role.IN, Role.OUT, Role.INOUT

#: Which collective an ``Op`` is: a key of the operation table's kinds (``aiodist.operations.KINDS``).
OpKind = str

#: Awaited before an operation reads its inputs (staged: until they are in host memory).
Gate = Callable[[], Awaitable[None]]


class Op(NamedTuple):
    """A checked collective, as the group hands it to its backend (immutable data).

    Attributes:
        kind: which collective (``all_gather_into_tensor`` is an ``all_gather`` of the output's
            blocks, ``reduce_scatter_tensor`` a ``reduce_scatter`` of the input's, the
            ``all_to_all`` forms one ``all_to_all`` of blocks).
        outputs: the arrays written (``gather``: empty off the root).
        inputs: the arrays read (``scatter``: empty off the root). An in-place operation
            (``broadcast``, ``all_reduce``, ``reduce``) has its one array in ``outputs``.
        root: the root's group rank, or -1.
        reduce_op: the reduction, for reductions.
        whole: the blocks are consecutive views of one buffer (``all_gather_into_tensor``'s
            outputs, ``reduce_scatter_tensor``'s inputs, both of ``all_to_all_single``), which
            torch's engine passes as one tensor.
    """

    kind: OpKind
    outputs: tuple[Array, ...] = ()
    inputs: tuple[Array, ...] = ()
    root: int = -1
    reduce_op: ReduceOp | None = None
    whole: bool = False


class Binding(Protocol):
    """One operation's tensors on a backend, from the group's checks to its start."""

    def tensor(self, obj: Any, *, arg: str, role: Role, writable: bool) -> Array:
        """The flat host array the checks and the algorithm see for the argument ``obj``.

        Raises:
            DistTypeError / DistValueError: ``obj`` is not a tensor this backend takes
                (``DeviceTensorError``: a device tensor, where nothing stages it).
        """
        ...

    def ready_now(self) -> None:
        """Block until the inputs are readable in host memory (before a send is queued)."""
        ...

    def start(self, ctx: OpContext, op: Op, timeout: float | None, gate: Gate | None = None) -> Work:
        """Run the numbered collective ``op`` (``ctx``: its key and fingerprint); its Work.

        ``gate`` (a wrapping backend's) is awaited before the operation reads its inputs.

        Raises:
            DistTypeError / DistValueError: this backend cannot run the checked ``op`` (torch's
                engine: PRODUCT on complex tensors); nothing started, and the group refuses
                the call, giving its number back.
        """
        ...

    def complete(self, work: Work) -> Work:
        """The Work of a point-to-point operation the group queued: ``work``, once outputs are in place."""
        ...

    def drop(self) -> None:
        """The operation was refused before it started: give back what ``tensor`` took."""
        ...


class TensorOps(Protocol):
    """The point-to-point operations of a backend whose own engine carries them (torch's),
    instead of the group's transport. The group has checked the arguments and named the
    operation; ``arr`` is what the backend's binding gave for the tensor; ranks are global."""

    def send(self, name: str, arr: Array, dst: int, tag: int, timeout: float | None) -> Work: ...
    def recv(self, name: str, arr: Array, src: int | None, tag: int, timeout: float | None) -> Work: ...
    def batch_isend_irecv(self, p2p_op_list: Sequence[Any]) -> list[Work] | None:
        """Start the whole list at once (NCCL coalesces it), or None: the group starts each."""
        ...


class BoundGroup(Protocol):
    """A group as its backend sees it (``aiodist.group.ProcessGroup`` is one): who its members
    are, and the two ways to start a numbered operation it tracks."""

    loop: asyncio.AbstractEventLoop
    gid: int
    name: str
    timeout: float
    rank: int  # this rank's group rank (-1: not a member)
    size: int
    global_rank: int
    ranks: tuple[int, ...]  # the members' global ranks, in group-rank order

    def group_rank(self, global_rank: int, arg: str = "rank") -> int: ...

    def check_usable(self, what: str) -> None: ...

    def p2p_args(self, what: str, peer: Any, tag: Any) -> tuple[int | None, int]:
        """The checked peer (a global rank) and tag of a send (``what="send"``) or a receive."""
        ...

    def track_collective(
        self,
        ctx: OpContext,
        coro: Coroutine[Any, Any, Any],
        timeout: float | None = None,
        *,
        survives_loss: bool = False,
    ) -> Work:
        """Run the algorithm ``coro`` of the numbered collective ``ctx`` (aiodist's algorithms)."""
        ...

    def run_steps(self, ctx: OpContext, steps: Steps, timeout: float | None = None) -> Work:
        """Run the numbered collective ``ctx`` as ``steps``, advanced by its arrivals (no task)."""
        ...

    def track_own(
        self,
        name: str,
        key: Key,
        fut: asyncio.Future[Any],
        timeout: float | None,
        timed_out: Callable[[float], BaseException],
    ) -> Work:
        """Track an operation the backend's own engine runs, completed by ``fut``."""
        ...


class Backend(Protocol):
    """What a group runs its tensor operations on; given to ``ProcessGroup`` at creation."""

    @property
    def own_ops(self) -> TensorOps | None:
        """What carries point-to-point operations (torch's engines), or None: the group's
        transport does. Collectives always start through ``bind``."""
        ...

    def bind(self, group: BoundGroup, what: str) -> Binding:
        """A binding for one operation ``what`` of ``group`` (see the module doc)."""
        ...

    def direct(self, obj: Any) -> bool:
        """True if ``obj``'s own memory is what an operation uses (no twin): its host view may
        be taken and checked on any thread (the blocking face's non-blocking sends)."""
        ...

    async def aclose(self) -> None:
        """Release what the backend holds (``destroy_process_group``)."""
        ...
