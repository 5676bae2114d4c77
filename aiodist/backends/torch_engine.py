"""Torch's own process-group engines behind aiodist's API: backends "nccl" and "torch-gloo".

``backend="nccl"`` runs the tensor operations of every group on torch's ``ProcessGroupNCCL``
(CUDA tensors); ``backend="torch-gloo"`` runs them on torch's ``ProcessGroupGloo`` (CPU
tensors), which every torch build has, so the adapter is tested where there is no GPU. The
adapter (``TorchEngine``) is the same for both; everything else is aiodist's:

- rendezvous: ``init_process_group``'s (init methods, rank assignment, ``group_name``); the
  engine meets its peers through the job's aiodist store, handed to torch as a
  ``torch.distributed.Store`` (``torch_store``). torch calls it from its own threads, so each
  call blocks on the store's coroutine running on the runtime loop; the engine is therefore
  built off the loop's thread (``asyncio.to_thread``), never on it.
- groups and ranks: a group is an aiodist ``ProcessGroup`` (global ranks for ``src``/``dst``,
  ``new_group``, non-members) whose backend (``TorchBackend``, given at its creation) runs its
  tensor operations. The group checks their arguments (``aiodist.operations``, with this
  backend's device rules), numbers them and times them out, as on every backend; the engine
  only translates the checked ``Op`` into torch's calls. The group's aiodist transport,
  connected as for "tcp", still carries object collectives, ``monitored_barrier`` and DDP's
  construction exchange, and watches the peers.
- Work: each operation returns an aiodist ``Work`` on the runtime loop, completed from torch's
  future (``Future.then`` -> ``loop.call_soon_threadsafe``) or, where torch's work has no
  future (gloo's send/recv), from a thread blocked in ``work.wait()``; never by polling.
  NCCL's future completes once the operation is queued on its stream: the Work then makes the
  caller's stream (current at the call) wait for it, as torch's ``work.wait()`` does.

Semantics kept from aiodist where the engines differ: AVG on integers truncates toward zero
(SUM, then a division), ``all_to_all`` blocks may differ in size per pair (gloo wants equal
ones: the blocks travel as one ``all_to_all_single``), and a ``timeout=`` fails the Work with
``DistTimeoutError`` from the group's deadline, with no resync exchange (the engine's own
timeout is the group's). torch's errors become aiodist's by type where torch has one
(``_error_class``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import importlib
import math
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import numpy as np

from aiodist import _tensors
from aiodist.backends import devices as _devices
from aiodist.backends.base import IN, OUT, Array, Binding, BoundGroup, Gate, Op, Role, TensorOps
from aiodist.collectives.context import OpContext
from aiodist.errors import (
    DistError,
    DistNetworkError,
    DistStoreError,
    DistTimeoutError,
    DistTypeError,
    DistValueError,
)
from aiodist.group import ProcessGroup
from aiodist.ops import ReduceOp
from aiodist.runtime.loop_thread import block_on
from aiodist.store import Store
from aiodist.store.blocking import StoreCalls
from aiodist.transport.base import P2P, Key
from aiodist.work import Work

__all__ = ["ENGINE_BACKENDS", "TorchBackend", "TorchEngine", "check_available", "start_engine", "torch_store"]

#: aiodist backend name -> torch engine.
ENGINE_BACKENDS = {"nccl": "nccl", "torch-gloo": "gloo"}

_NO_LIMIT = datetime.timedelta(days=365)


def _torch() -> tuple[Any, Any]:
    torch = importlib.import_module("torch")
    return torch, importlib.import_module("torch.distributed")


def check_available(backend: str) -> None:
    """Raise a clear ``DistValueError`` if this build cannot run ``backend``'s engine.

    Raises:
        DistValueError: torch is missing, or for "nccl": no CUDA device or no NCCL in torch.
    """
    try:
        torch, td = _torch()
    except ImportError as exc:
        raise DistValueError(f"backend {backend!r} runs torch's own engine: install torch") from exc
    if ENGINE_BACKENDS[backend] == "gloo":
        if not td.is_available() or not hasattr(td, "ProcessGroupGloo"):
            raise DistValueError("backend 'torch-gloo' needs torch built with distributed (gloo) support")
        return
    if not torch.cuda.is_available():
        raise DistValueError(
            "backend 'nccl' needs CUDA, and this machine or torch build has none "
            f"(torch {torch.__version__}); use backend 'tcp' (CPU tensors, and CUDA tensors "
            "staged through host memory where CUDA exists)"
        )
    if not td.is_nccl_available():
        raise DistValueError(f"backend 'nccl': this torch build ({torch.__version__}) has no NCCL")


def cuda_device(device_id: Any) -> Any:
    """``device_id`` (an int, ``"cuda:N"`` or a ``torch.device``) as a ``torch.device``.

    Raises:
        DistValueError: not a CUDA device, or CUDA is not available.
        DistTypeError: not a device at all.
    """
    torch, _ = _torch()
    if isinstance(device_id, bool) or not isinstance(device_id, int | str | torch.device):
        raise DistTypeError(
            f"device_id must be a torch.device, 'cuda:N' or an int, not {type(device_id).__name__}"
        )
    device = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
    if device.type != "cuda":
        raise DistValueError(f"device_id must be a CUDA device, got {device}")
    if not torch.cuda.is_available():
        raise DistValueError(f"device_id={device} was given, but this machine or torch build has no CUDA")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.index >= torch.cuda.device_count():
        raise DistValueError(f"device_id={device}: this machine has {torch.cuda.device_count()} CUDA devices")
    return device


# -- the store, as torch sees it ---------------------------------------------------------------

T = TypeVar("T")

_store_class: Any = None


def torch_store(store: Store, loop: asyncio.AbstractEventLoop) -> Any:
    """``store`` as a ``torch.distributed.Store`` whose methods block on ``loop``.

    torch calls these methods from its own threads; each call runs the aiodist store's
    coroutine on ``loop`` and waits for it. A call from ``loop``'s own thread would wait for
    itself: it raises ``DistStoreError`` instead.
    """
    global _store_class
    if _store_class is None:
        _store_class = _make_store_class()
    return _store_class(store, loop)


def _store_on_loop() -> DistStoreError:
    return DistStoreError(
        "torch called the aiodist store on the runtime loop's own thread, where it would "
        "wait for itself; torch process groups must be built and driven off that thread"
    )


def _make_store_class() -> Any:
    _, td = _torch()
    base: Any = td.Store

    class AiodistTorchStore(StoreCalls, base):  # type: ignore[misc]
        """An aiodist store seen by torch's engines (see ``torch_store``)."""

        def __init__(self, store: Store, loop: asyncio.AbstractEventLoop) -> None:
            super().__init__()
            self.async_store = store
            self._store = store
            self._loop = loop

        def _call(self, coro: Coroutine[Any, Any, T]) -> T:
            return block_on(self._loop, coro, _store_on_loop)

        def has_extended_api(self) -> bool:
            return True

    return AiodistTorchStore


# -- building an engine ------------------------------------------------------------------------------


async def start_engine(
    backend: str, store: Store, group: ProcessGroup, *, timeout: float, host: str, device: Any = None
) -> TorchEngine:
    """Build the torch engine of ``group`` (a member's view) off the loop thread.

    Every member calls it for the same group at about the same time: torch's engine meets
    its peers through ``store`` (give each group a prefix of its own).

    Args:
        backend: "nccl" or "torch-gloo".
        store: the rendezvous store of this group's engine.
        group: the aiodist group the engine serves (its rank and size are the engine's).
        timeout: the engine's own timeout for every operation, seconds.
        host: the address gloo listens on (the one aiodist's transport uses).
        device: NCCL: the CUDA device of this rank (default: the current one); the engine's
            communicator is connected on it here.
    Raises:
        DistError: torch could not build or connect the engine (its error is the cause).
    """
    torch, td = _torch()
    kind = ENGINE_BACKENDS[backend]
    if kind == "nccl" and device is None:
        device = cuda_device(torch.cuda.current_device())
    tstore = torch_store(store, group.loop)
    limit = datetime.timedelta(seconds=timeout) if math.isfinite(timeout) and timeout > 0 else _NO_LIMIT

    def build() -> Any:
        if kind == "gloo":
            opts = td.ProcessGroupGloo._Options()
            opts._devices = [td.ProcessGroupGloo.create_device(hostname=host, lazy_init=False)]
            opts._timeout = limit
            return td.ProcessGroupGloo(tstore, group.rank, group.size, opts)
        opts = td.ProcessGroupNCCL.Options()
        opts._timeout = limit
        pg = td.ProcessGroupNCCL(tstore, group.rank, group.size, opts)
        # Connect now, here: lazily, NCCL would read the store from the loop's thread.
        pg.eager_connect_single_device(device)
        return pg

    try:
        pg = await asyncio.to_thread(build)
    except DistError:
        raise
    except Exception as exc:
        raise DistError(
            f"rank {group.global_rank}: torch's {kind} engine for {group.name} could not start: {exc}"
        ) from exc
    return TorchEngine(backend, pg, group, device)


class TorchBackend:
    """A group's backend on torch's engine: given to the group at creation, connected by
    ``connect`` (every member, at about the same time). The group checks, numbers and times
    out every operation; the engine runs it (``bind``: collectives; ``own_ops``: the
    point-to-point operations, which travel on torch's engine rather than the group's transport).

    Args:
        backend: "nccl" or "torch-gloo".
        store: the rendezvous store of this group's engine.
        host: the address gloo listens on.
        device: NCCL: the CUDA device of this rank.
    """

    def __init__(self, backend: str, store: Store, *, host: str, device: Any = None) -> None:
        self.backend = backend
        self._store = store
        self._host = host
        self._device = device
        self.engine: TorchEngine | None = None

    def __repr__(self) -> str:
        return f"<TorchBackend {self.backend} {self.engine!r}>"

    @property
    def own_ops(self) -> TensorOps | None:
        return self.engine

    async def connect(self, group: ProcessGroup) -> None:
        """Build torch's engine for ``group`` (a member's view; see ``start_engine``)."""
        self.engine = await start_engine(
            self.backend, self._store, group, timeout=group.timeout, host=self._host, device=self._device
        )

    def bind(self, group: BoundGroup, what: str) -> Binding:
        if self.engine is None:
            raise DistError(
                f"{what} on rank {group.global_rank}: torch's engine of {group.name} is not connected"
            )
        return _EngineBinding(self.engine, what)

    def direct(self, obj: Any) -> bool:
        return False

    async def aclose(self) -> None:
        if self.engine is not None:
            await self.engine.aclose()


# -- what the group's checks see ------------------------------------------------------------------


class _EngineArray:
    """A tensor argument as the group's checks see it on torch's engine: its dtype (numpy's),
    its size, and slices of it (the blocks ``aiodist.operations`` cuts), without viewing its
    memory from numpy (a CUDA tensor stays on its device). ``tensor()``: the flat torch tensor
    of those elements, sharing memory with the caller's."""

    __slots__ = ("dtype", "flat", "start", "stop")

    def __init__(self, flat: Any, dtype: np.dtype[Any], start: int, stop: int) -> None:
        self.flat, self.dtype, self.start, self.stop = flat, dtype, start, stop

    @property
    def size(self) -> int:
        return self.stop - self.start

    def __getitem__(self, s: slice) -> _EngineArray:
        start, stop, step = s.indices(self.size)
        if step != 1:
            raise DistValueError("a block of a tensor is a contiguous range of its elements")
        return _EngineArray(self.flat, self.dtype, self.start + start, self.start + max(start, stop))

    def tensor(self) -> Any:
        return self.flat[self.start : self.stop]


def _span(blocks: Sequence[Any]) -> Any:
    """The one tensor that the consecutive blocks ``blocks`` of one argument cover (the group
    cuts ``all_gather_into_tensor``'s output, ``reduce_scatter_tensor``'s input and both
    tensors of ``all_to_all_single`` into such blocks; torch's engine takes them whole)."""
    first, last = blocks[0], blocks[-1]
    return first.flat[first.start : last.stop]


class _EngineBinding:
    """One operation's tensors on torch's engine: the device rules, then the tensor itself."""

    __slots__ = ("device", "engine", "what")

    def __init__(self, engine: TorchEngine, what: str) -> None:
        self.engine = engine
        self.what = what
        self.device = _devices.OneDevice()

    def tensor(self, obj: Any, *, arg: str, role: Role, writable: bool) -> Array:
        t = self.engine.tensor(obj, arg, writable=writable)
        self.device.check(arg, str(t.device))
        flat = t.reshape(-1)
        return _EngineArray(flat, _tensors.numpy_dtype_for(t.dtype), 0, flat.numel())

    def ready_now(self) -> None:
        pass  # torch's engine orders its operations after the caller's work itself (NCCL: streams)

    def start(self, ctx: OpContext, op: Op, timeout: float | None, gate: Gate | None = None) -> Work:
        if gate is not None:
            raise DistError(f"{self.what}: torch's engine runs on the caller's tensors; nothing may gate it")
        return self.engine.start(ctx, op, timeout)

    def complete(self, work: Work) -> Work:
        return work

    def drop(self) -> None:
        pass


# -- torch's errors -------------------------------------------------------------------------------


def _error_of(fut: Any) -> BaseException | None:
    try:
        fut.value()
    except Exception as exc:
        return exc
    return None


def _wait_error(work: Any) -> BaseException | None:
    try:
        work.wait()
    except Exception as exc:
        return exc
    return None


def _error_class(td: Any, exc: BaseException) -> tuple[type[DistError], str]:
    """aiodist's class for an error torch's engine reported, and what it says happened.

    By type where torch has one (``torch.distributed.DistNetworkError``, ``DistStoreError``);
    a timeout has no class in torch, and gloo reports every failure as a plain RuntimeError,
    so those are read from their text (``_plain_error_class``).
    """
    if isinstance(exc, td.DistNetworkError):
        return DistNetworkError, "lost a peer"
    if isinstance(exc, td.DistStoreError):
        return DistStoreError, "lost its store"
    if type(exc) is RuntimeError or isinstance(exc, td.DistBackendError):
        return _plain_error_class(str(exc))
    return DistError, "failed"


def _plain_error_class(text: str) -> tuple[type[DistError], str]:
    """Classify an engine error that torch gives no type for, by its text.

    gloo raises a plain RuntimeError for everything, and torch has no timeout class (NCCL's
    watchdog reports a timeout as a DistBackendError). The messages recognised (torch 2.13):
    gloo's "Timed out waiting <N>ms for recv operation to complete" and "Application timeout
    caused pair closure" (timeouts), its "Connection closed by peer [addr]" and "Connection
    reset by peer" (lost peers), and NCCL's "Watchdog caught collective operation timeout".
    """
    lower = text.lower()
    if "timed out" in lower or "timeout" in lower:
        return DistTimeoutError, "timed out"
    if "closed" in lower or "reset" in lower or "peer" in lower:
        return DistNetworkError, "lost a peer"
    return DistError, "failed"


# -- the adapter ------------------------------------------------------------------------------------


class TorchEngine:
    """Runs the checked, numbered operations of one aiodist group on a torch process group.

    The group checks each operation's arguments, numbers it and times it out (``TorchBackend``'s
    binding hands the checked ``Op`` to ``start``); the engine translates it into torch's calls,
    fills in what torch's engines lack, and completes the Work from torch's future. Its
    ``send``/``recv``/``batch_isend_irecv`` are the backend's ``own_ops``: point-to-point
    operations travel on torch's engine, not on the group's transport.

    Attributes:
        backend: "nccl" or "torch-gloo".
        pg: torch's engine (``ProcessGroupNCCL`` / ``ProcessGroupGloo``).
        group: the aiodist group served.
    """

    def __init__(self, backend: str, pg: Any, group: BoundGroup, device: Any = None) -> None:
        self.backend = backend
        self.kind = ENGINE_BACKENDS[backend]
        self.pg = pg
        self.group = group
        self.loop = group.loop
        self.device = device
        self._pending: set[asyncio.Future[Any]] = set()
        self._closed = False
        self._torch, self._td = _torch()
        self._c10d = importlib.import_module("torch._C._distributed_c10d")  # the *Options classes

    def __repr__(self) -> str:
        return f"<TorchEngine {self.kind} {self.group.name} rank={self.group.rank}/{self.group.size}>"

    # -- lifetime ----------------------------------------------------------------------------------
    def _fail_pending(self, reason: str) -> bool:
        pending = [f for f in self._pending if not f.done()]
        for fut in pending:
            fut.set_exception(DistError(f"rank {self.group.global_rank}: {reason}"))
        return bool(pending)

    def abort(self, reason: str = "the process group was aborted") -> None:
        """Fail every pending operation with ``DistError(reason)`` and abort torch's engine now."""
        if self._closed:
            return
        self._closed = True
        self._fail_pending(reason)
        with contextlib.suppress(Exception):
            self.pg.abort()

    async def aclose(self, reason: str = "the process group was destroyed") -> None:
        """Fail pending operations and shut torch's engine down (in a worker thread: it may wait)."""
        if self._closed:
            return
        self._closed = True
        stop = self.pg.abort if self._fail_pending(reason) else self.pg.shutdown
        with contextlib.suppress(Exception):
            await asyncio.to_thread(stop)

    # -- tensors ---------------------------------------------------------------------------------------
    def tensor(self, obj: Any, arg: str, *, writable: bool) -> Any:
        """``obj`` as a torch tensor on the engine's kind of device, sharing memory.

        Raises:
            DistValueError: on another kind of device (``aiodist.backends.devices.check_device``), not
                contiguous, read-only while ``writable`` (numpy).
            DistTypeError: not a tensor, or an unsupported dtype.
        """
        if isinstance(obj, np.ndarray):
            _devices.check_device(self.backend, arg, "cpu", "cpu (a numpy array)")
            return _tensors.to_torch(_tensors.as_array(obj, arg=arg, writable=writable).reshape(obj.shape))
        _tensors.check_tensor(obj, arg=arg)
        _devices.check_device(self.backend, arg, obj.device.type, str(obj.device))
        return obj.detach()

    def _reduction(
        self, rop: ReduceOp, out: Any, inputs: Sequence[Any] = ()
    ) -> tuple[Any, Any, list[Any], Callable[[], None] | None]:
        """What the engine runs for reducing into ``out``: ``(torch op, out, inputs, after)``.

        Where the engines lack what aiodist offers, this rank completes the job (``after``):
        AVG on integers is a SUM, then a division truncating toward zero; int16 (neither engine
        has int16 arithmetic) is reduced as int32 and wrapped back, the same bits as int16
        arithmetic; NCCL reduces complex numbers as pairs of reals (SUM and AVG only).
        """
        torch = self._torch
        if out.is_complex() and rop is ReduceOp.PRODUCT:
            raise DistTypeError(
                f"ReduceOp.PRODUCT on complex tensors: torch's {self.kind} engine cannot compute it; use backend 'tcp'"
            )
        wide = out.dtype == torch.int16
        out_e = out.to(torch.int32) if wide else out
        ins_e = [t.to(torch.int32) for t in inputs] if wide else list(inputs)
        if self.kind == "nccl" and out.is_complex():
            out_e, ins_e = torch.view_as_real(out), [torch.view_as_real(t) for t in ins_e]
        steps: list[Callable[[], Any]] = []
        if wide:
            steps.append(lambda: out.copy_(out_e))
        torch_op = getattr(self._td.ReduceOp, rop.name)
        if rop is ReduceOp.AVG and not (out.is_floating_point() or out.is_complex()):
            n = self.group.size
            torch_op = self._td.ReduceOp.SUM
            steps.append(lambda: out.copy_(torch.div(out, n, rounding_mode="trunc")))

        def after() -> None:
            for step in steps:
                step()

        return torch_op, out_e, ins_e, after if steps else None

    def _bytes(self, t: Any) -> Any:
        """The bytes of ``t`` (flat uint8): operations that only move data take every dtype so."""
        return t.reshape(-1).view(self._torch.uint8)

    # -- collectives ---------------------------------------------------------------------------------
    # Operations that only move data hand the engine the tensors' bytes (every dtype works, gloo's
    # gaps included); reductions hand it the tensors themselves (see ``_reduction``).

    def start(self, ctx: OpContext, op: Op, timeout: float | None) -> Work:
        """Run the collective ``op`` the group checked and numbered (``ctx``); its Work, timed
        out by the group.

        Raises:
            DistTypeError / DistValueError: the engine cannot run ``op`` (nothing started).
            DistError: torch's engine failed to start it.
        """
        assert ctx.fp is not None
        name = f"{ctx.fp[0]} #{ctx.fp[1]}"
        opts, call, after = self._translate(op)
        return self._run(name, ctx.key, opts, timeout, call, after=after)

    def _translate(self, op: Op) -> tuple[Any, Callable[[Any], Any], Callable[[], None] | None]:
        """torch's options, the call that issues ``op`` on the engine, and what follows its completion."""
        c10d, pg = self._c10d, self.pg
        outs = [a.tensor() for a in op.outputs]
        ins = [a.tensor() for a in op.inputs]
        rop = op.reduce_op or ReduceOp.SUM
        opts: Any
        match op.kind:
            case "barrier":
                opts = c10d.BarrierOptions()
                if self.device is not None:
                    opts.device_ids = [self.device.index]
                return opts, lambda o: pg.barrier(o), None
            case "broadcast":
                opts = c10d.BroadcastOptions()
                opts.rootRank, opts.rootTensor = op.root, 0
                t = self._bytes(outs[0])
                return opts, lambda o: pg.broadcast([t], o), None
            case "all_reduce":
                opts = c10d.AllreduceOptions()
                opts.reduceOp, t_e, _, after = self._reduction(rop, outs[0])
                return opts, lambda o: pg.allreduce([t_e], o), after
            case "reduce":
                opts = c10d.ReduceOptions()
                opts.reduceOp, t_e, _, after = self._reduction(rop, outs[0])
                if self.group.rank != op.root:
                    # An engine may use a non-root's buffer as scratch; aiodist leaves it untouched.
                    t_e, after = t_e.clone(), None
                opts.rootRank, opts.rootTensor = op.root, 0
                return opts, lambda o: pg.reduce([t_e], o), after
            case "all_gather":
                opts = c10d.AllgatherOptions()
                in_b = self._bytes(ins[0])
                if op.whole:
                    out_b = self._bytes(_span(op.outputs))
                    return opts, lambda o: pg._allgather_base(out_b, in_b, o), None
                outs_b = [self._bytes(t) for t in outs]
                return opts, lambda o: pg.allgather([outs_b], [in_b], o), None
            case "gather":
                opts = c10d.GatherOptions()
                opts.rootRank = op.root
                gathered = [[self._bytes(t) for t in outs]] if outs else []
                in_b = self._bytes(ins[0])
                return opts, lambda o: pg.gather(gathered, [in_b], o), None
            case "scatter":
                opts = c10d.ScatterOptions()
                opts.rootRank = op.root
                scattered = [[self._bytes(t) for t in ins]] if ins else []
                out_b = self._bytes(outs[0])
                return opts, lambda o: pg.scatter([out_b], scattered, o), None
            case "reduce_scatter":
                opts = c10d.ReduceScatterOptions()
                if op.whole:
                    opts.reduceOp, out_e, (inp_e,), after = self._reduction(rop, outs[0], [_span(op.inputs)])
                    out_f, inp_f = out_e.reshape(-1), inp_e.reshape(-1)
                    return opts, lambda o: pg._reduce_scatter_base(out_f, inp_f, o), after
                opts.reduceOp, out_e, ins_e, after = self._reduction(rop, outs[0], ins)
                return opts, lambda o: pg.reduce_scatter([out_e], [ins_e], o), after
            case "all_to_all":
                return self._all_to_all(op, outs, ins)
            case _:
                raise DistValueError(f"{op.kind} is not run by torch's {self.kind} engine: use backend 'tcp'")

    def _all_to_all(
        self, op: Op, outs: list[Any], ins: list[Any]
    ) -> tuple[Any, Callable[[Any], Any], Callable[[], None] | None]:
        """Blocks of any size per pair (gloo's own all_to_all wants equal ones), in one exchange
        of bytes cut by split sizes: ``all_to_all_single``'s tensors as they are, the blocks of
        ``all_to_all`` gathered into one buffer each way."""
        torch, pg = self._torch, self.pg
        opts = self._c10d.AllToAllOptions()
        out_splits = [t.numel() * t.element_size() for t in outs]
        in_splits = [t.numel() * t.element_size() for t in ins]
        if op.whole:
            out_b, in_b = self._bytes(_span(op.outputs)), self._bytes(_span(op.inputs))
            return opts, lambda o: pg.alltoall_base(out_b, in_b, out_splits, in_splits, o), None
        flat_in = torch.cat([self._bytes(t) for t in ins])
        flat_out = torch.empty(sum(out_splits), dtype=torch.uint8, device=flat_in.device)

        def unpack() -> None:
            for t, block in zip(outs, torch.split(flat_out, out_splits), strict=True):
                self._bytes(t).copy_(block)

        return opts, lambda o: pg.alltoall_base(flat_out, flat_in, out_splits, in_splits, o), unpack

    # -- point-to-point (``TorchBackend.own_ops``) ------------------------------------------------------
    def send(self, name: str, arr: Array, dst: int, tag: int, timeout: float | None) -> Work:
        """Send ``arr`` (the binding's view, checked by the group) to global rank ``dst``."""
        peer = self.group.group_rank(dst, "dst")
        t = self._bytes(arr.tensor())
        key = (self.group.gid, P2P, tag)
        return self._run(name, key, None, timeout, lambda _: self.pg.send([t], peer, tag))

    def recv(self, name: str, arr: Array, src: int | None, tag: int, timeout: float | None) -> Work:
        """Receive into ``arr`` from global rank ``src`` (None: any member); the Work's result is the sender."""
        if src is None and self.kind == "nccl":
            raise DistValueError("recv: backend 'nccl' cannot receive from any source; pass src")
        t = self._bytes(arr.tensor())
        key = (self.group.gid, P2P, tag)
        if src is None:
            ranks = self.group.ranks
            return self._run(
                name,
                key,
                None,
                timeout,
                lambda _: self.pg.recv_anysource([t], tag),
                result=lambda work: ranks[work._source_rank()],
            )
        peer = self.group.group_rank(src, "src")
        return self._run(
            name, key, None, timeout, lambda _: self.pg.recv([t], peer, tag), result=lambda _: src
        )

    def batch_isend_irecv(self, p2p_op_list: Sequence[Any]) -> list[Work] | None:
        """NCCL: start every send and receive of the list as one coalesced group (unless
        coalesced, a send and a receive between one pair could wait for each other). Other
        engines: None, the group starts them one by one."""
        if self.kind != "nccl":
            return None
        name = f"batch_isend_irecv of {len(p2p_op_list)}"
        self.group.check_usable(name)
        issue = [self._p2p_call(p) for p in p2p_op_list]
        self._coalescing("_start_coalescing")
        try:
            for call in issue:
                call()
        finally:
            coalesced = self._coalescing("_end_coalescing")
        # The coalesced work stands for all of them.
        shared = self._watch(coalesced, name, (self.group.gid, P2P, 0), None)
        return [shared for _ in issue]

    def _coalescing(self, method: str) -> Any:
        fn = getattr(self.pg, method)
        try:
            return fn(self.device)
        except TypeError:  # torch builds differ on whether these take the device
            return fn()

    def _p2p_call(self, p: Any) -> Callable[[], Any]:
        """One checked operation of a coalesced list, ready to issue."""
        peer = p.peer if p.group_peer is None else self.group.ranks[p.group_peer]
        sending = getattr(p.op, "__name__", "") in ("isend", "send")
        if peer is None:
            raise DistValueError("batch_isend_irecv on backend 'nccl' needs a peer for every receive")
        peer, tag = self.group.p2p_args("send" if sending else "recv", peer, p.tag)
        assert peer is not None
        r = self.group.group_rank(peer)
        arr = _EngineBinding(self, "batch_isend_irecv").tensor(
            p.tensor, arg="tensor", role=IN if sending else OUT, writable=not sending
        )
        t = self._bytes(arr.tensor())
        if sending:
            return lambda: self.pg.send([t], r, tag)
        return lambda: self.pg.recv([t], r, tag)

    # -- running -------------------------------------------------------------------------------------
    def _run(
        self,
        name: str,
        key: Key,
        opts: Any,
        timeout: float | None,
        call: Callable[[Any], Any],
        *,
        after: Callable[[], None] | None = None,
        result: Callable[[Any], Any] | None = None,
    ) -> Work:
        """Issue ``call(opts)`` on torch's engine and watch the work it returns."""
        if opts is not None and timeout is not None:
            opts.timeout = datetime.timedelta(seconds=timeout)
        try:
            work = call(opts)
        except (ValueError, TypeError) as exc:
            cls = DistTypeError if isinstance(exc, TypeError) else DistValueError
            raise cls(f"{name}: torch's {self.kind} engine refused the call: {exc}") from exc
        except RuntimeError as exc:
            raise DistError(
                f"{name} on rank {self.group.global_rank}: torch's {self.kind} engine: {exc}"
            ) from exc
        return self._watch(work, name, key, timeout, after=after, result=result)

    def _watch(
        self,
        work: Any,
        name: str,
        key: Key,
        timeout: float | None,
        *,
        after: Callable[[], None] | None = None,
        result: Callable[[Any], Any] | None = None,
    ) -> Work:
        """An aiodist Work completed by torch's ``work``, timed out by the group."""
        loop = self.loop
        fut: asyncio.Future[Any] = loop.create_future()
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        stream = self._torch.cuda.current_stream(self.device) if self.kind == "nccl" else None

        def signal(error: BaseException | None) -> None:  # on any thread
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                loop.call_soon_threadsafe(self._settle, fut, work, name, error, stream, after, result)

        try:
            tfut = work.get_future()
        except RuntimeError:  # gloo's send/recv have no future: a thread waits instead
            tfut = None
        if tfut is not None:
            tfut.then(lambda f: signal(_error_of(f)))
        else:
            threading.Thread(
                target=lambda: signal(_wait_error(work)), name=f"aiodist-engine {name}", daemon=True
            ).start()
        return self.group.track_own(name, key, fut, timeout, lambda t: self._timeout_error(name, t))

    def _settle(
        self,
        fut: asyncio.Future[Any],
        work: Any,
        name: str,
        error: BaseException | None,
        stream: Any,
        after: Callable[[], None] | None,
        result: Callable[[Any], Any] | None,
    ) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(self._map_error(error, name))
            return
        try:
            if stream is not None:
                with self._torch.cuda.stream(stream):
                    work.wait()  # the caller's stream waits for the operation
                    if after is not None:
                        after()
            elif after is not None:
                after()
            fut.set_result(result(work) if result is not None else None)
        except Exception as exc:
            fut.set_exception(self._map_error(exc, name))

    def _timeout_error(self, name: str, t: float) -> DistTimeoutError:
        """What the group fails an operation with at its deadline: no resync exchange follows
        (aiodist's transport never carried it; torch's engine abandons it itself)."""
        return DistTimeoutError(
            f"{name} on rank {self.group.global_rank} ({self.group.name}) reached its timeout of {t:g} s "
            f"in torch's {self.kind} engine"
        )

    def _map_error(self, exc: BaseException, name: str) -> DistError:
        cls, what = _error_class(self._td, exc)
        err = cls(
            f"{name} on rank {self.group.global_rank} ({self.group.name}) {what} in torch's {self.kind} engine: {exc}"
        )
        err.__cause__ = exc
        return err
