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
  tensor operations (``ProcessGroup`` hands them to ``own_ops``). The group's aiodist transport, connected as for "tcp", still carries object
  collectives, ``monitored_barrier`` and DDP's construction exchange, and watches the peers.
- Work: each operation returns an aiodist ``Work`` on the runtime loop, completed from torch's
  future (``Future.then`` -> ``loop.call_soon_threadsafe``) or, where torch's work has no
  future (gloo's send/recv), from a thread blocked in ``work.wait()``; never by polling.
  NCCL's future completes once the operation is queued on its stream: the Work then makes the
  caller's stream (current at the call) wait for it, as torch's ``work.wait()`` does.

Semantics kept from aiodist where the engines differ: AVG on integers truncates toward zero
(SUM, then a division), ``all_to_all`` blocks may differ in size per pair (gloo wants equal
ones: the blocks travel as one ``all_to_all_single``), and a ``timeout=`` fails the Work with
``DistTimeoutError`` (the engine's own timeout is the group's).
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
from aiodist.backends.base import Binding, TensorOps
from aiodist.errors import (
    DistError,
    DistNetworkError,
    DistStoreError,
    DistTimeoutError,
    DistTypeError,
    DistValueError,
)
from aiodist.group import ProcessGroup
from aiodist.ops import ReduceOp, check_reduce
from aiodist.runtime.loop_thread import block_on
from aiodist.store import Store
from aiodist.store.blocking import StoreCalls
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
    ``connect`` (every member, at about the same time), then it runs whole operations.

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

    def bind(self, group: ProcessGroup, what: str) -> Binding:
        raise DistError(
            f"{what} on rank {group.global_rank}: torch's engine of {group.name} is not connected"
        )

    def direct(self, obj: Any) -> bool:
        return False

    async def aclose(self) -> None:
        if self.engine is not None:
            await self.engine.aclose()


# -- the adapter ------------------------------------------------------------------------------------


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


class TorchEngine:
    """Runs the tensor operations of one aiodist group on a torch process group.

    Its methods have the signatures of the async face's operations (``aiodist.all_reduce``...,
    the ``TensorOps`` protocol); the ``ProcessGroup`` it serves calls them (``TorchBackend.own_ops``).
    ``group`` arguments are ignored (the engine serves one group); ranks are global, as everywhere.

    Attributes:
        backend: "nccl" or "torch-gloo".
        pg: torch's engine (``ProcessGroupNCCL`` / ``ProcessGroupGloo``).
        group: the aiodist group served.
    """

    def __init__(self, backend: str, pg: Any, group: ProcessGroup, device: Any = None) -> None:
        self.backend = backend
        self.kind = ENGINE_BACKENDS[backend]
        self.pg = pg
        self.group = group
        self.loop = group.loop
        self.device = device
        self._seq = 0
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

    # -- arguments -----------------------------------------------------------------------------------
    def _start_name(self, what: str, *, collective: bool = True) -> str:
        """Check that the group is usable; the operation's name ("all_reduce #3": collectives are numbered)."""
        self.group.check_usable(what)
        if not collective:
            return what
        name = f"{what} #{self._seq}"
        self._seq += 1
        return name

    def _tensor(self, obj: Any, arg: str, *, writable: bool) -> Any:
        """``obj`` as a torch tensor of the engine's device, sharing memory."""
        if isinstance(obj, np.ndarray):
            if self.kind == "nccl":
                raise self._wrong_device(arg, "cpu (a numpy array)")
            return _tensors.to_torch(_tensors.as_array(obj, arg=arg, writable=writable).reshape(obj.shape))
        _tensors.check_tensor(obj, arg=arg)
        if obj.device.type != ("cuda" if self.kind == "nccl" else "cpu"):
            raise self._wrong_device(arg, str(obj.device))
        return obj.detach()

    def _wrong_device(self, arg: str, where: str) -> DistValueError:
        if self.kind == "nccl":
            return DistValueError(
                f"{arg} is on {where}, but backend 'nccl' runs CUDA tensors only: move it to this "
                "rank's GPU (tensor.cuda()), or use backend 'tcp'"
            )
        return DistValueError(
            f"{arg} is on {where}, but backend 'torch-gloo' runs CPU tensors only: use backend "
            "'nccl' for CUDA tensors, or 'tcp' (which stages them through host memory)"
        )

    def _tensor_list(self, objs: Any, arg: str, *, writable: bool, length: int | None) -> list[Any]:
        if not isinstance(objs, list | tuple):
            raise DistTypeError(f"{arg} must be a list of tensors, got {type(objs).__qualname__}")
        if length is not None and len(objs) != length:
            raise DistValueError(f"{arg} must have one tensor per group member ({length}), got {len(objs)}")
        return [self._tensor(o, f"{arg}[{i}]", writable=writable) for i, o in enumerate(objs)]

    @staticmethod
    def _one_device(named: Sequence[tuple[str, Any]]) -> None:
        first: tuple[str, str] | None = None
        for arg, t in named:
            where = str(t.device)
            if first is None:
                first = (arg, where)
            elif where != first[1]:
                raise DistValueError(
                    f"the tensors of one call must be on one device: {first[0]} is on {first[1]} "
                    f"but {arg} is on {where}"
                )

    @staticmethod
    def _same(arg: str, t: Any, like_arg: str, like: Any, *, numel: int | None = None) -> None:
        if t.dtype != like.dtype:
            raise DistTypeError(f"{arg} has dtype {t.dtype} but {like_arg} has {like.dtype}")
        if numel is not None and t.numel() != numel:
            raise DistValueError(f"{arg} has {t.numel()} elements but {numel} were expected")

    def _reduction(
        self, op: Any, out: Any, inputs: Sequence[Any] = ()
    ) -> tuple[Any, Any, list[Any], Callable[[], None] | None]:
        """What the engine runs for reducing into ``out``: ``(torch op, out, inputs, after)``.

        Where the engines lack what aiodist offers, this rank completes the job (``after``):
        AVG on integers is a SUM, then a division truncating toward zero; int16 (neither engine
        has int16 arithmetic) is reduced as int32 and wrapped back, the same bits as int16
        arithmetic; NCCL reduces complex numbers as pairs of reals (SUM and AVG only).
        """
        torch = self._torch
        rop = check_reduce(op, _tensors.numpy_dtype_for(out.dtype))
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

    # -- running -------------------------------------------------------------------------------------
    def _run(
        self,
        name: str,
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
        return self._watch(work, name, timeout, after=after, result=result)

    def _watch(
        self,
        work: Any,
        name: str,
        timeout: float | None,
        *,
        after: Callable[[], None] | None = None,
        result: Callable[[Any], Any] | None = None,
    ) -> Work:
        """An aiodist Work completed by torch's ``work``."""
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
        t = self.group.timeout if timeout is None else timeout
        if t is not None and 0 < t < float("inf"):
            timer = loop.call_later(t, self._timed_out, fut, name, t)
            fut.add_done_callback(lambda _: timer.cancel())
        return Work(fut, name)

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

    def _timed_out(self, fut: asyncio.Future[Any], name: str, t: float) -> None:
        if not fut.done():
            fut.set_exception(
                DistTimeoutError(
                    f"{name} on rank {self.group.global_rank} ({self.group.name}) reached its timeout of {t:g} s "
                    f"in torch's {self.kind} engine"
                )
            )

    def _map_error(self, exc: BaseException, name: str) -> DistError:
        text = str(exc)
        lower = text.lower()
        where = f"{name} on rank {self.group.global_rank} ({self.group.name})"
        err: DistError
        if "timed out" in lower or "timeout" in lower:
            err = DistTimeoutError(f"{where} timed out in torch's {self.kind} engine: {text}")
        elif "closed" in lower or "reset" in lower or "peer" in lower:
            err = DistNetworkError(f"{where} lost a peer in torch's {self.kind} engine: {text}")
        else:
            err = DistError(f"{where} failed in torch's {self.kind} engine: {text}")
        err.__cause__ = exc
        return err

    # -- collectives ---------------------------------------------------------------------------------
    # Operations that only move data hand the engine the tensors' bytes (every dtype works, gloo's
    # gaps included); reductions hand it the tensors themselves (see ``_reduction``).

    def broadcast(self, tensor: Any, src: int, group: Any = None, *, timeout: float | None = None) -> Work:
        name = self._start_name("broadcast")
        root = self.group.group_rank(src, "src")
        t = self._bytes(self._tensor(tensor, "tensor", writable=self.group.rank != root))
        opts = self._c10d.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        return self._run(name, opts, timeout, lambda o: self.pg.broadcast([t], o))

    def all_reduce(
        self, tensor: Any, op: Any = ReduceOp.SUM, group: Any = None, *, timeout: float | None = None
    ) -> Work:
        name = self._start_name("all_reduce")
        t = self._tensor(tensor, "tensor", writable=True)
        opts = self._c10d.AllreduceOptions()
        opts.reduceOp, t_e, _, after = self._reduction(op, t)
        return self._run(name, opts, timeout, lambda o: self.pg.allreduce([t_e], o), after=after)

    def reduce(
        self,
        tensor: Any,
        dst: int,
        op: Any = ReduceOp.SUM,
        group: Any = None,
        *,
        timeout: float | None = None,
    ) -> Work:
        name = self._start_name("reduce")
        root = self.group.group_rank(dst, "dst")
        is_root = self.group.rank == root
        t = self._tensor(tensor, "tensor", writable=is_root)
        opts = self._c10d.ReduceOptions()
        opts.reduceOp, t_e, _, after = self._reduction(op, t)
        if not is_root:
            # An engine may use a non-root's buffer as scratch; aiodist leaves it untouched.
            t_e, after = t_e.clone(), None
        opts.rootRank, opts.rootTensor = root, 0
        return self._run(name, opts, timeout, lambda o: self.pg.reduce([t_e], o), after=after)

    def all_gather(
        self, tensor_list: Any, tensor: Any, group: Any = None, *, timeout: float | None = None
    ) -> Work:
        name = self._start_name("all_gather")
        inp = self._tensor(tensor, "tensor", writable=False)
        outs = self._tensor_list(tensor_list, "tensor_list", writable=True, length=self.group.size)
        for i, o in enumerate(outs):
            self._same(f"tensor_list[{i}]", o, "tensor", inp, numel=inp.numel())
        self._one_device([("tensor", inp), *((f"tensor_list[{i}]", o) for i, o in enumerate(outs))])
        out_b, in_b = [self._bytes(o) for o in outs], self._bytes(inp)
        return self._run(
            name, self._c10d.AllgatherOptions(), timeout, lambda o: self.pg.allgather([out_b], [in_b], o)
        )

    def all_gather_into_tensor(
        self, output_tensor: Any, input_tensor: Any, group: Any = None, *, timeout: float | None = None
    ) -> Work:
        name = self._start_name("all_gather_into_tensor")
        inp = self._tensor(input_tensor, "input_tensor", writable=False)
        out = self._tensor(output_tensor, "output_tensor", writable=True)
        self._same("output_tensor", out, "input_tensor", inp, numel=inp.numel() * self.group.size)
        self._one_device([("output_tensor", out), ("input_tensor", inp)])
        out_b, in_b = self._bytes(out), self._bytes(inp)
        return self._run(
            name, self._c10d.AllgatherOptions(), timeout, lambda o: self.pg._allgather_base(out_b, in_b, o)
        )

    all_gather_single = all_gather_into_tensor

    def gather(
        self,
        tensor: Any,
        gather_list: Any = None,
        dst: int = 0,
        group: Any = None,
        *,
        timeout: float | None = None,
    ) -> Work:
        name = self._start_name("gather")
        root = self.group.group_rank(dst, "dst")
        inp = self._tensor(tensor, "tensor", writable=False)
        outputs: list[list[Any]] = []
        if self.group.rank == root:
            if gather_list is None:
                raise DistValueError("gather: gather_list is required on the destination rank")
            outs = self._tensor_list(gather_list, "gather_list", writable=True, length=self.group.size)
            for i, o in enumerate(outs):
                self._same(f"gather_list[{i}]", o, "tensor", inp, numel=inp.numel())
            self._one_device([("tensor", inp), *((f"gather_list[{i}]", o) for i, o in enumerate(outs))])
            outputs = [[self._bytes(o) for o in outs]]
        elif gather_list:
            raise DistValueError("gather: gather_list must not be given on ranks other than dst")
        opts = self._c10d.GatherOptions()
        opts.rootRank = root
        in_b = self._bytes(inp)
        return self._run(name, opts, timeout, lambda o: self.pg.gather(outputs, [in_b], o))

    def scatter(
        self,
        tensor: Any,
        scatter_list: Any = None,
        src: int = 0,
        group: Any = None,
        *,
        timeout: float | None = None,
    ) -> Work:
        name = self._start_name("scatter")
        root = self.group.group_rank(src, "src")
        out = self._tensor(tensor, "tensor", writable=True)
        inputs: list[list[Any]] = []
        if self.group.rank == root:
            if scatter_list is None:
                raise DistValueError("scatter: scatter_list is required on the source rank")
            ins = self._tensor_list(scatter_list, "scatter_list", writable=False, length=self.group.size)
            for i, t in enumerate(ins):
                self._same(f"scatter_list[{i}]", t, "tensor", out, numel=out.numel())
            self._one_device([("tensor", out), *((f"scatter_list[{i}]", t) for i, t in enumerate(ins))])
            inputs = [[self._bytes(t) for t in ins]]
        elif scatter_list:
            raise DistValueError("scatter: scatter_list must not be given on ranks other than src")
        opts = self._c10d.ScatterOptions()
        opts.rootRank = root
        out_b = self._bytes(out)
        return self._run(name, opts, timeout, lambda o: self.pg.scatter([out_b], inputs, o))

    def reduce_scatter(
        self,
        output: Any,
        input_list: Any,
        op: Any = ReduceOp.SUM,
        group: Any = None,
        *,
        timeout: float | None = None,
    ) -> Work:
        name = self._start_name("reduce_scatter")
        out = self._tensor(output, "output", writable=True)
        ins = self._tensor_list(input_list, "input_list", writable=False, length=self.group.size)
        for i, t in enumerate(ins):
            self._same(f"input_list[{i}]", t, "output", out, numel=out.numel())
        self._one_device([("output", out), *((f"input_list[{i}]", t) for i, t in enumerate(ins))])
        opts = self._c10d.ReduceScatterOptions()
        opts.reduceOp, out_e, ins_e, after = self._reduction(op, out, [t.view(out.shape) for t in ins])
        return self._run(
            name, opts, timeout, lambda o: self.pg.reduce_scatter([out_e], [ins_e], o), after=after
        )

    def reduce_scatter_tensor(
        self,
        output: Any,
        input: Any,
        op: Any = ReduceOp.SUM,
        group: Any = None,
        *,
        timeout: float | None = None,
    ) -> Work:
        name = self._start_name("reduce_scatter_tensor")
        out = self._tensor(output, "output", writable=True)
        inp = self._tensor(input, "input", writable=False)
        self._same("input", inp, "output", out, numel=out.numel() * self.group.size)
        self._one_device([("output", out), ("input", inp)])
        opts = self._c10d.ReduceScatterOptions()
        opts.reduceOp, out_e, (inp_e,), after = self._reduction(op, out, [inp])
        out_f, inp_f = out_e.reshape(-1), inp_e.reshape(-1)
        return self._run(
            name, opts, timeout, lambda o: self.pg._reduce_scatter_base(out_f, inp_f, o), after=after
        )

    reduce_scatter_single = reduce_scatter_tensor

    def all_to_all(
        self,
        output_tensor_list: Any,
        input_tensor_list: Any,
        group: Any = None,
        *,
        timeout: float | None = None,
    ) -> Work:
        name = self._start_name("all_to_all")
        n = self.group.size
        ins = self._tensor_list(input_tensor_list, "input_tensor_list", writable=False, length=n)
        outs = self._tensor_list(output_tensor_list, "output_tensor_list", writable=True, length=n)
        for i, t in enumerate(outs):
            self._same(f"output_tensor_list[{i}]", t, "input_tensor_list[0]", ins[0])
        for i, t in enumerate(ins):
            self._same(f"input_tensor_list[{i}]", t, "input_tensor_list[0]", ins[0])
        self._one_device(
            [*((f"input_tensor_list[{i}]", t) for i, t in enumerate(ins))]
            + [(f"output_tensor_list[{i}]", t) for i, t in enumerate(outs)]
        )
        # Blocks of any size per pair (gloo's own all_to_all wants equal ones), in one exchange:
        # the bytes of every block in one buffer each way, cut by split sizes.
        torch = self._torch
        flat_in = torch.cat([self._bytes(t) for t in ins])
        in_splits = [t.numel() * t.element_size() for t in ins]
        out_splits = [t.numel() * t.element_size() for t in outs]
        flat_out = torch.empty(sum(out_splits), dtype=torch.uint8, device=flat_in.device)

        def unpack() -> None:
            for t, block in zip(outs, torch.split(flat_out, out_splits), strict=True):
                self._bytes(t).copy_(block)

        return self._run(
            name,
            self._c10d.AllToAllOptions(),
            timeout,
            lambda o: self.pg.alltoall_base(flat_out, flat_in, out_splits, in_splits, o),
            after=unpack,
        )

    def all_to_all_single(
        self,
        output: Any,
        input: Any,
        output_split_sizes: Any = None,
        input_split_sizes: Any = None,
        group: Any = None,
        *,
        timeout: float | None = None,
    ) -> Work:
        name = self._start_name("all_to_all_single")
        out = self._tensor(output, "output", writable=True)
        inp = self._tensor(input, "input", writable=False)
        self._same("output", out, "input", inp)
        self._one_device([("output", out), ("input", inp)])
        # In bytes: the split sizes (rows along dim 0) become byte counts.
        osz = self._byte_splits(output_split_sizes, "output_split_sizes", out)
        isz = self._byte_splits(input_split_sizes, "input_split_sizes", inp)
        out_b, in_b = self._bytes(out), self._bytes(inp)
        return self._run(
            name,
            self._c10d.AllToAllOptions(),
            timeout,
            lambda o: self.pg.alltoall_base(out_b, in_b, osz, isz, o),
        )

    def _byte_splits(self, sizes: Any, arg: str, t: Any) -> list[int]:
        if sizes is None or (isinstance(sizes, list | tuple) and not sizes):
            return []
        rows = t.shape[0] if t.dim() else 1
        row_bytes = (t.numel() // rows if rows else 0) * t.element_size()
        try:
            splits = [int(s) for s in sizes]
        except (TypeError, ValueError):
            raise DistTypeError(f"{arg} must be a list of ints, got {sizes!r}") from None
        if len(splits) != self.group.size:
            raise DistValueError(
                f"{arg} must have one entry per group member ({self.group.size}), got {len(splits)}"
            )
        if sum(splits) != rows or min(splits) < 0:
            raise DistValueError(
                f"{arg} {splits} must be non-negative and sum to the {rows} rows of the tensor"
            )
        return [s * row_bytes for s in splits]

    def barrier(self, group: Any = None, *, timeout: float | None = None) -> Work:
        name = self._start_name("barrier")
        opts = self._c10d.BarrierOptions()
        if self.device is not None:
            opts.device_ids = [self.device.index]
        return self._run(name, opts, timeout, lambda o: self.pg.barrier(o))

    # -- point-to-point ------------------------------------------------------------------------------
    def _peer(self, rank: Any, arg: str, what: str) -> int:
        r = self.group.group_rank(rank, arg)
        if r == self.group.rank:
            raise DistValueError(f"{what}: {arg}={rank} is this process's own rank")
        return r

    def send(
        self, tensor: Any, dst: int, group: Any = None, tag: int = 0, *, timeout: float | None = None
    ) -> Work:
        name = self._start_name(f"send to rank {dst} (tag {tag})", collective=False)
        peer = self._peer(dst, "dst", "send")
        t = self._bytes(self._tensor(tensor, "tensor", writable=False))
        return self._run(name, None, timeout, lambda _: self.pg.send([t], peer, int(tag)))

    def recv(
        self,
        tensor: Any,
        src: int | None = None,
        group: Any = None,
        tag: int = 0,
        *,
        timeout: float | None = None,
    ) -> Work:
        name = self._start_name(
            f"recv from {'any rank' if src is None else f'rank {src}'} (tag {tag})", collective=False
        )
        t = self._bytes(self._tensor(tensor, "tensor", writable=True))
        if src is None and self.kind == "nccl":
            raise DistValueError("recv: backend 'nccl' cannot receive from any source; pass src")
        if src is None:
            ranks = self.group.ranks
            return self._run(
                name,
                None,
                timeout,
                lambda _: self.pg.recv_anysource([t], int(tag)),
                result=lambda work: ranks[work._source_rank()],
            )
        peer = self._peer(src, "src", "recv")
        return self._run(
            name, None, timeout, lambda _: self.pg.recv([t], peer, int(tag)), result=lambda _: src
        )

    isend = send
    irecv = recv

    def batch_isend_irecv(self, p2p_op_list: Sequence[Any]) -> list[Work]:
        """Start every send and receive of the list; NCCL runs them as one coalesced group."""
        if self.kind != "nccl":
            return [self._p2p(p) for p in p2p_op_list]
        # NCCL: unless coalesced, a send and a receive between one pair could wait for each other.
        name = self._start_name(f"batch_isend_irecv of {len(p2p_op_list)}", collective=False)
        issue = [self._p2p(p, issue_only=True) for p in p2p_op_list]
        self._coalescing("_start_coalescing")
        try:
            for call in issue:
                call()
        finally:
            coalesced = self._coalescing("_end_coalescing")
        shared = self._watch(coalesced, name, None)  # the coalesced work stands for all of them
        return [shared for _ in issue]

    def _coalescing(self, method: str) -> Any:
        fn = getattr(self.pg, method)
        try:
            return fn(self.device)
        except TypeError:  # torch builds differ on whether these take the device
            return fn()

    def _p2p(self, p: Any, *, issue_only: bool = False) -> Any:
        peer = p.peer if p.group_peer is None else self.group.ranks[p.group_peer]
        sending = getattr(p.op, "__name__", "") in ("isend", "send")
        if not issue_only:
            return self.send(p.tensor, peer, tag=p.tag) if sending else self.recv(p.tensor, peer, tag=p.tag)
        if peer is None:
            raise DistValueError("batch_isend_irecv on backend 'nccl' needs a peer for every receive")
        r = self._peer(peer, "peer", "batch_isend_irecv")
        t = self._bytes(self._tensor(p.tensor, "tensor", writable=not sending))
        tag = int(p.tag)
        if sending:
            return lambda: self.pg.send([t], r, tag)
        return lambda: self.pg.recv([t], r, tag)
