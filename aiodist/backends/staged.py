"""Staging device tensors through host buffers, for aiodist's own (TCP) transport.

The transport reads and writes host memory, so a CUDA tensor given to an operation of a "tcp"
group travels through a *twin*: a host tensor of the same shape and dtype over a buffer from
the stager's pool (pinned memory for CUDA, so the copies are real asynchronous DMA).

How one staged operation runs (``StagedBackend``, which wraps the native backend; the group
asks its binding for each tensor argument while it checks the call):

1. At the call, every tensor argument the stager wants is replaced by its twin. An input starts
   its copy into the twin at once: CUDA does it on a side stream that first waits for the
   caller's current stream, so the copy sees every kernel queued before the call.
2. The operation itself starts at once, on the twins, so that it takes its place in the
   group's call order. A collective's algorithm first awaits the input copies (the gate the
   binding hands the native backend); a send waits for its copy before it is queued
   (``ready_now``), which keeps messages of one (peer, tag) in order.
3. Once the operation has completed, outputs are copied back into the caller's tensors (CUDA:
   on the stream that was current at the call), and once those copies ran, the buffers go back
   to the pool; only then does the Work complete. A failed operation's buffers are dropped,
   never reused (a receive abandoned by a timeout may still be written into).

The pool (``BufferPool``) rounds sizes up to power-of-two buckets, keeps released buffers for
reuse, and caches at most ``max_cached_bytes`` (buffers in use are not limited: an operation
never waits for another one's buffer). ``destroy_process_group`` closes it.

Two stagers share this contract: ``CudaStager`` (torch.cuda streams, events, pinned memory) and
``HostStager``, which stages CPU tensors through plain host buffers. The tests install the
latter (``aiodist.face.world.set_stager``) to run every step above except the device hop itself.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from aiodist import _tensors
from aiodist.backends.base import IN, INOUT, OUT, Backend, Binding, BoundGroup, Gate, Op, Role, TensorOps
from aiodist.backends.devices import OneDevice
from aiodist.errors import DistError, DistValueError
from aiodist.work import Work

if TYPE_CHECKING:
    from aiodist.collectives.context import OpContext

__all__ = [
    "DEFAULT_MAX_CACHED_BYTES",
    "IN",
    "INOUT",
    "MIN_BUCKET",
    "OUT",
    "Block",
    "BufferPool",
    "CudaStager",
    "HostStager",
    "Role",
    "Staged",
    "StagedBackend",
    "Stager",
    "check_one_device",
    "on_caller_stream",
]

MIN_BUCKET = 4096
"""The smallest buffer the pool hands out (one page)."""

DEFAULT_MAX_CACHED_BYTES = 1 << 30
"""How many bytes of released buffers a pool keeps for reuse (1 GiB)."""


# -- the pool ----------------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class Block:
    """One buffer of a pool: ``buf`` is ``size`` bytes (a uint8 array or tensor)."""

    buf: Any
    size: int
    pooled: bool
    live: bool = True


class BufferPool:
    """Reusable host buffers in power-of-two size buckets; the cache is bounded.

    Used only from the runtime loop's thread. ``alloc(nbytes)`` makes a new buffer (a numpy
    uint8 array, or a pinned torch uint8 tensor).

    Args:
        alloc: allocates a buffer of exactly ``nbytes`` bytes.
        max_cached_bytes: released buffers are kept while their total stays within this; a
            request larger than it gets a buffer of its exact size, freed after use.
        min_bucket: the smallest bucket.
    """

    def __init__(
        self,
        alloc: Callable[[int], Any],
        *,
        max_cached_bytes: int = DEFAULT_MAX_CACHED_BYTES,
        min_bucket: int = MIN_BUCKET,
    ) -> None:
        if min_bucket <= 0 or min_bucket & (min_bucket - 1):
            raise DistValueError(f"min_bucket must be a power of two, got {min_bucket}")
        self._alloc = alloc
        self.max_cached_bytes = max_cached_bytes
        self.min_bucket = min_bucket
        self._free: dict[int, list[Any]] = {}
        self.cached_bytes = 0
        self.in_use_bytes = 0
        self.hits = 0
        self.misses = 0
        self.closed = False

    def __repr__(self) -> str:
        return (
            f"<BufferPool cached={self.cached_bytes} in_use={self.in_use_bytes} "
            f"hits={self.hits} misses={self.misses}{' closed' if self.closed else ''}>"
        )

    def bucket(self, nbytes: int) -> int:
        """The size of the buffer that serves a request of ``nbytes``."""
        if nbytes <= self.min_bucket:
            return self.min_bucket
        return 1 << (nbytes - 1).bit_length()

    def acquire(self, nbytes: int) -> Block:
        """A buffer of at least ``nbytes``: a cached one of the bucket's size, else a new one.

        Raises:
            DistError: the pool was closed (its process group was destroyed).
        """
        if self.closed:
            raise DistError("the staging buffer pool was released by destroy_process_group")
        size = self.bucket(nbytes)
        if size > self.max_cached_bytes:
            self.misses += 1
            block = Block(self._alloc(nbytes), nbytes, pooled=False)
        else:
            free = self._free.get(size)
            if free:
                buf = free.pop()
                self.cached_bytes -= size
                self.hits += 1
            else:
                buf = self._alloc(size)
                self.misses += 1
            block = Block(buf, size, pooled=True)
        self.in_use_bytes += block.size
        return block

    def release(self, block: Block) -> None:
        """Give ``block`` back for reuse (dropped if the cache is full or the pool closed)."""
        if not self._retire(block):
            return
        if block.pooled and not self.closed and self.cached_bytes + block.size <= self.max_cached_bytes:
            self._free.setdefault(block.size, []).append(block.buf)
            self.cached_bytes += block.size

    def discard(self, block: Block) -> None:
        """Drop ``block`` without reuse (something may still write into it)."""
        self._retire(block)

    def _retire(self, block: Block) -> bool:
        if not block.live:
            return False
        block.live = False
        self.in_use_bytes -= block.size
        return True

    def close(self) -> None:
        """Free every cached buffer; later ``acquire`` calls raise, later releases drop."""
        self.closed = True
        self._free.clear()
        self.cached_bytes = 0


# -- the stager interface -------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class Staged:
    """One staged tensor of one operation.

    Attributes:
        tensor: the caller's tensor.
        host: its twin, which the operation reads and writes.
        block: the pool buffer under ``host``.
        copy_out: the operation writes the tensor: copy ``host`` back when it succeeded.
        stream: CUDA: the caller's current stream at the call (copies back are queued on it).
        pending: the copy-in not yet known to be done (CUDA: an event; host: True).
        views: host stager: flat views of (the caller's data, the twin's data).
    """

    tensor: Any
    host: Any
    block: Block
    copy_out: bool
    stream: Any = None
    pending: Any = None
    views: tuple[Any, Any] = field(default=(None, None))


class Stager(Protocol):
    """Moves tensors between their device and host twins; one per job (``World.stager``).

    Every method runs on the runtime loop's thread.
    """

    pool: BufferPool
    #: True when host tensors are staged too (``HostStager``, for tests): every call is staged.
    stages_host_tensors: bool

    def wants(self, obj: object) -> bool:
        """True if ``obj`` (an argument of an operation) must travel through a twin."""
        ...

    def stage(self, obj: Any, *, arg: str, copy_in: bool, copy_out: bool) -> Staged:
        """Validate ``obj``, give it a twin and start copying it in when ``copy_in``.

        Raises:
            DistTypeError / DistValueError: ``obj`` is not a tensor an operation accepts.
        """
        ...

    def wait_ready(self, staged: Sequence[Staged]) -> None:
        """Block until the copies in of ``staged`` are done (before a send is queued)."""
        ...

    async def ready(self, staged: Sequence[Staged]) -> None:
        """Wait, without blocking the loop, until the copies in of ``staged`` are done."""
        ...

    async def finish(self, staged: Sequence[Staged]) -> None:
        """Copy the outputs back into the caller's tensors, wait for that, release the buffers."""
        ...

    def discard(self, staged: Sequence[Staged]) -> None:
        """After a failure: drop the buffers of ``staged`` without copying anything back."""
        ...

    def close(self) -> None:
        """Free the pool (``destroy_process_group``)."""
        ...


# -- the CPU stager ------------------------------------------------------------------------------


class HostStager:
    """The stager contract over plain host memory: CPU tensors go through pooled twins.

    Nothing needs staging on the CPU; this exists so that everything of staging except the
    device hop runs in tests on machines without a GPU. Copies in happen in ``ready`` /
    ``wait_ready`` (not in ``stage``), as they complete asynchronously on a device, and fresh
    or reused buffers are filled with garbage (``poison``) so that an operation that read a
    twin before its copy arrived, or a result never copied back, shows as wrong data.

    Attributes:
        copies_in, copies_out: how many tensors were copied each way (for tests).
    """

    stages_host_tensors = True

    def __init__(self, *, max_cached_bytes: int = DEFAULT_MAX_CACHED_BYTES, poison: bool = True) -> None:
        self.pool = BufferPool(_host_buffer, max_cached_bytes=max_cached_bytes)
        self.poison = poison
        self.copies_in = 0
        self.copies_out = 0

    def wants(self, obj: object) -> bool:
        return _tensors.is_tensor_like(obj) and _tensors.device_of(obj) == "cpu"

    def stage(self, obj: Any, *, arg: str, copy_in: bool, copy_out: bool) -> Staged:
        user = _tensors.as_array(obj, arg=arg, writable=copy_out)
        shape = _tensors.describe(obj, arg=arg)[2]
        block = self.pool.acquire(user.nbytes)
        raw = block.buf[: user.nbytes]
        if self.poison:
            raw.fill(0xA5)
        twin = raw.view(user.dtype)
        host = twin.reshape(shape)
        if _tensors.is_torch_tensor(obj):
            host = _tensors.to_torch(host)
        return Staged(obj, host, block, copy_out, pending=True if copy_in else None, views=(user, twin))

    def _copy_in(self, staged: Sequence[Staged]) -> None:
        for s in staged:
            if s.pending is not None:
                np.copyto(s.views[1], s.views[0])
                s.pending = None
                self.copies_in += 1

    def wait_ready(self, staged: Sequence[Staged]) -> None:
        self._copy_in(staged)

    async def ready(self, staged: Sequence[Staged]) -> None:
        await asyncio.sleep(0)  # completes later, as a device copy does
        self._copy_in(staged)

    async def finish(self, staged: Sequence[Staged]) -> None:
        await asyncio.sleep(0)
        for s in staged:
            if s.copy_out:
                np.copyto(s.views[0], s.views[1])
                self.copies_out += 1
            self.pool.release(s.block)

    def discard(self, staged: Sequence[Staged]) -> None:
        for s in staged:
            self.pool.discard(s.block)

    def close(self) -> None:
        self.pool.close()


def _host_buffer(nbytes: int) -> Any:
    return np.empty(nbytes, np.uint8)


# -- the CUDA stager -----------------------------------------------------------------------------


class CudaStager:
    """Stages CUDA tensors through pinned host buffers (torch.cuda streams and events).

    Copies in run on one side stream per device, after the caller's current stream; copies
    back run on the caller's stream of the call. The loop never blocks on the device except
    before a send (``wait_ready``): waits for events run in a worker thread. torch.cuda is
    touched only when a CUDA tensor is staged.
    """

    stages_host_tensors = False

    def __init__(self, *, max_cached_bytes: int = DEFAULT_MAX_CACHED_BYTES) -> None:
        self.pool = BufferPool(_pinned_buffer, max_cached_bytes=max_cached_bytes)
        self._side_streams: dict[Any, Any] = {}

    def wants(self, obj: object) -> bool:
        return _tensors._is_cuda(obj)

    def _side_stream(self, device: Any) -> Any:
        stream = self._side_streams.get(device)
        if stream is None:
            stream = self._side_streams[device] = sys.modules["torch"].cuda.Stream(device=device)
        return stream

    def stage(self, obj: Any, *, arg: str, copy_in: bool, copy_out: bool) -> Staged:
        torch = sys.modules["torch"]
        _tensors.check_tensor(obj, arg=arg)
        tensor = obj.detach()
        nbytes = tensor.numel() * tensor.element_size()
        block = self.pool.acquire(nbytes)
        host = block.buf[:nbytes].view(tensor.dtype).view(tensor.shape)
        caller = torch.cuda.current_stream(tensor.device)
        event = None
        if copy_in:
            side = self._side_stream(tensor.device)
            side.wait_stream(caller)  # the copy sees every kernel queued before the call
            with torch.cuda.stream(side):
                host.copy_(tensor, non_blocking=True)
                event = torch.cuda.Event()
                event.record(side)
        return Staged(tensor, host, block, copy_out, stream=caller, pending=event)

    def wait_ready(self, staged: Sequence[Staged]) -> None:
        for s in staged:
            if s.pending is not None:
                s.pending.synchronize()
                s.pending = None

    async def ready(self, staged: Sequence[Staged]) -> None:
        events = [s.pending for s in staged if s.pending is not None]
        if events:
            await asyncio.to_thread(_synchronize, events)
        for s in staged:
            s.pending = None

    async def finish(self, staged: Sequence[Staged]) -> None:
        torch = sys.modules["torch"]
        events = []
        try:
            for s in staged:
                if s.copy_out:
                    with torch.cuda.stream(s.stream):
                        s.tensor.copy_(s.host, non_blocking=True)
                        event = torch.cuda.Event()
                        event.record(s.stream)
                    events.append(event)
            if events:
                # The buffers may be reused only once the copies out of them ran.
                await asyncio.to_thread(_synchronize, events)
        except BaseException:
            self.discard(staged)
            raise
        for s in staged:
            self.pool.release(s.block)

    def discard(self, staged: Sequence[Staged]) -> None:
        # torch's pinned allocator keeps a buffer alive until the copies queued on it ran.
        for s in staged:
            self.pool.discard(s.block)

    def close(self) -> None:
        self.pool.close()
        self._side_streams.clear()


def _pinned_buffer(nbytes: int) -> Any:
    torch = sys.modules["torch"]
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _synchronize(events: Sequence[Any]) -> None:
    for event in events:
        event.synchronize()


def on_caller_stream(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn``, to be run on another thread under this thread's current CUDA stream.

    The sync face starts operations on the runtime loop's thread, but torch's current stream
    (and device) is per thread: this carries the caller's over, so that staging copies and
    NCCL order themselves after the caller's kernels. ``fn`` itself unless CUDA is in use.
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return fn
    stream = torch.cuda.current_stream()

    def on_stream() -> Any:
        with torch.cuda.stream(stream):
            return fn()

    return on_stream


def check_one_device(items: Sequence[tuple[str, Any]]) -> None:
    """Refuse tensors on different devices in one call (numpy arrays count as "cpu").

    Args:
        items: ``(argument name, value)``; values that are not tensors are skipped.
    Raises:
        DistValueError: naming the first two arguments that disagree.
    """
    one = OneDevice()
    for label, obj in items:
        if _tensors.is_tensor_like(obj):
            one.check(label, _tensors.device_of(obj))


# -- the staged backend ------------------------------------------------------------------------


class StagedBackend:
    """Wraps another backend: the tensors its stager wants travel through host twins.

    One per job, shared by its groups on aiodist's transport (``World.staged``). ``stager``
    may be replaced (``aiodist.face.world.set_stager``) or None (device tensors refused).
    """

    def __init__(self, inner: Backend, stager: Stager | None) -> None:
        self.inner = inner
        self.stager = stager
        self.own_ops: TensorOps | None = None

    def __repr__(self) -> str:
        return f"<StagedBackend {type(self.stager).__name__} over {self.inner!r}>"

    def bind(self, group: BoundGroup, what: str) -> Binding:
        inner = self.inner.bind(group, what)
        if self.stager is None:
            return inner
        return _StagedBinding(inner, self.stager, group.loop)

    def direct(self, obj: Any) -> bool:
        return not (self.stager is not None and _tensors.is_tensor_like(obj) and self.stager.wants(obj))

    async def aclose(self) -> None:
        if self.stager is not None:
            self.stager.close()  # frees the staging pool


class _StagedBinding:
    """One operation's staged tensors (see the module doc): twins at the call, the algorithm
    held until the inputs are in, outputs copied back before the Work completes."""

    __slots__ = ("_device", "inner", "loop", "staged", "stager")

    def __init__(self, inner: Binding, stager: Stager, loop: asyncio.AbstractEventLoop) -> None:
        self.inner = inner
        self.stager = stager
        self.loop = loop
        self.staged: list[Staged] = []
        self._device = OneDevice()  # the call's tensors are on one device

    def tensor(self, obj: Any, *, arg: str, role: Role, writable: bool) -> Any:
        if _tensors.is_tensor_like(obj):
            self._device.check(arg, _tensors.device_of(obj))
            if self.stager.wants(obj):
                s = self.stager.stage(obj, arg=arg, copy_in=role is not OUT, copy_out=role is not IN)
                self.staged.append(s)
                obj = s.host
        return self.inner.tensor(obj, arg=arg, role=role, writable=writable)

    def ready_now(self) -> None:
        self.stager.wait_ready(self.staged)

    def start(self, ctx: OpContext, op: Op, timeout: float | None, gate: Gate | None = None) -> Work:
        if not self.staged:
            return self.inner.start(ctx, op, timeout, gate)
        staged = self.staged

        async def inputs_in() -> None:
            if gate is not None:
                await gate()
            await self.stager.ready(staged)

        return self.complete(self.inner.start(ctx, op, timeout, inputs_in))

    def complete(self, work: Work) -> Work:
        work = self.inner.complete(work)
        if not self.staged:
            return work
        return Work(self.loop.create_task(_complete(self.stager, self.staged, work)), work.name)

    def drop(self) -> None:
        self.stager.discard(self.staged)
        self.inner.drop()


async def _complete(stager: Stager, staged: list[Staged], work: Work) -> Any:
    try:
        result = await work
    except BaseException:
        stager.discard(staged)
        raise
    await stager.finish(staged)
    return result
