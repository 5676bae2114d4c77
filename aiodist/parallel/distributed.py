"""``DistributedDataParallel``: torch's DDP on the aiodist runtime (needs torch).

How it works. At construction every rank describes its module (names, shapes, dtypes of the
parameters and buffers) to every other rank in one exchange, so a rank that never comes, or
one whose model differs, is named on all ranks; rank 0's parameters and buffers are then
broadcast in flattened buckets. The parameters requiring grad are split into buckets in
reverse order (the ones backward reaches first, first): 1 MiB for the first bucket, then
``bucket_cap_mb``. A post-accumulate-grad hook on each parameter copies its gradient
(pre-divided by the world size) into its slot of the bucket's flat buffer; when a bucket's
last slot is filled, its all_reduce is posted to the runtime loop and backward goes on while
the loop moves the bytes. Buckets start in index order, so every rank issues them in the
same order. A callback queued on the autograd engine runs when backward ends: it waits for
every bucket and writes the averages into ``param.grad`` (or leaves the grads as views of the
buckets with ``gradient_as_bucket_view=True``).

Relation to torch 2.13's layout. torch builds these buckets too, but only from the second
iteration, after re-bucketing in the order gradients became ready in the first; and only with
``bucket_cap_mb=None``: an explicit cap makes torch's first bucket that size as well. aiodist
buckets once, at construction, in reverse parameter order with the 1 MiB first bucket (smaller
than the cap; a cap below 1 MiB is used for every bucket). Averages do not depend on the
layout: each element is reduced on its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgpack
import torch

from aiodist.errors import DistError, DistTypeError, DistValueError
from aiodist.face.world import resolve_group
from aiodist.group import ProcessGroup
from aiodist.parallel import _comm
from aiodist.parallel.bucketing import reverse_order_buckets

__all__ = ["DistributedDataParallel", "GradBucket", "Reducer"]

CommHook = Callable[[Any, "GradBucket"], Any]
"""``hook(state, bucket) -> Future`` of the reduced flat tensor (``torch.futures.Future``)."""


class GradBucket:
    """One bucket of flattened gradients, as a communication hook sees it (torch's ``GradBucket``).

    ``buffer()`` holds the bucket's gradients back to back (not yet divided by the world size);
    the hook returns a future of the reduced tensor of the same size, usually ``buffer()`` itself.
    """

    __slots__ = ("_buffer", "_grads", "_index", "_last", "_params")

    def __init__(self, index: int, buffer: Any, params: list[Any], grads: list[Any], last: bool) -> None:
        self._index = index
        self._buffer = buffer
        self._params = params
        self._grads = grads
        self._last = last

    def index(self) -> int:
        """Position of the bucket; bucket 0 is the first to be reduced."""
        return self._index

    def buffer(self) -> Any:
        """The flat 1-D tensor of the bucket's gradients."""
        return self._buffer

    def set_buffer(self, buffer: Any) -> None:
        """Replace the flat tensor (same size); the reducer reads the reduced values from the future."""
        self._buffer = buffer

    def gradients(self) -> list[Any]:
        """One view of ``buffer()`` per parameter, shaped like it."""
        return list(self._grads)

    def parameters(self) -> list[Any]:
        """The bucket's parameters, in the order of their slots."""
        return list(self._params)

    def is_last(self) -> bool:
        """True for the bucket reduced last in an iteration."""
        return self._last

    def __repr__(self) -> str:
        return (
            f"<GradBucket {self._index} of {len(self._params)} parameters, {self._buffer.numel()} elements>"
        )


@dataclasses.dataclass(eq=False)
class _Bucket:
    index: int
    indices: list[int]  # reducer parameter indices, in slot order
    flat: Any
    views: list[Any]
    pending: int = 0
    future: Any = None


def _queue_engine_callback(fn: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def _find_tensors(obj: Any) -> Iterator[Any]:
    """Every tensor in a forward output: tensors, sequences, mappings, dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, list | tuple):
        for item in obj:
            yield from _find_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _find_tensors(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _find_tensors(getattr(obj, f.name))


def _reachable_leaves(outputs: Sequence[Any]) -> set[int]:
    """``id`` of every leaf tensor the autograd graph of ``outputs`` accumulates a gradient into."""
    found: set[int] = set()
    seen: set[Any] = set()
    stack = []
    for t in outputs:
        if not t.requires_grad:
            continue
        if t.grad_fn is None:
            found.add(id(t))  # a parameter returned as it is
        else:
            stack.append(t.grad_fn)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if variable is not None:
            found.add(id(variable))
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                stack.append(child)
    return found


def _wait_value(fut: Any, bucket: _Bucket) -> Any:
    """Wait for what a hook returned and give the reduced flat tensor."""
    if isinstance(fut, torch.futures.Future):
        value = fut.wait()
    elif hasattr(fut, "result") and callable(fut.result) and hasattr(fut, "done"):
        value = fut.result()  # concurrent.futures.Future
    elif hasattr(fut, "wait") and callable(fut.wait):
        fut.wait()  # an aiodist Work: its result is None, the tensor was reduced in place
        value = None
    else:
        raise DistTypeError(
            f"the communication hook of bucket {bucket.index} returned {type(fut).__name__}, "
            "not a torch.futures.Future"
        )
    if isinstance(value, list | tuple):
        value = value[0] if value else None
    return bucket.flat if value is None else value


class Reducer:
    """Averages gradients across the group in buckets while backward runs.

    Args:
        params: the parameters to synchronise (requiring grad, each once), in model order.
        names: their qualified names, for messages.
        group: the process group.
        bucket_cap_mb: cap of every bucket after the first (1 MiB, or the cap if smaller).
        find_unused_parameters: walk the graph from the forward's outputs and mark the
            parameters it does not reach as ready at the start of backward.
        gradient_as_bucket_view: leave each ``param.grad`` as a view into its bucket.
    """

    def __init__(
        self,
        params: Sequence[Any],
        names: Sequence[str],
        group: ProcessGroup,
        bucket_cap_mb: float,
        find_unused_parameters: bool,
        gradient_as_bucket_view: bool,
    ) -> None:
        self._params = list(params)
        self._names = list(names)
        self._group = group
        self._find_unused = find_unused_parameters
        self._as_view = gradient_as_bucket_view
        self._scale = 1.0 / group.size
        self._hook: CommHook | None = None
        self._hook_state: Any = None
        n = len(self._params)
        assignment = reverse_order_buckets(self._params, bucket_cap_mb) if n else []
        self._buckets: list[_Bucket] = []
        self._where: list[tuple[int, int]] = [(0, 0)] * n
        with torch.no_grad():
            for b, indices in enumerate(assignment):
                members = [self._params[i] for i in indices]
                total = sum(int(p.numel()) for p in members)
                flat = torch.zeros(total, dtype=members[0].dtype, device=members[0].device)
                views, offset = [], 0
                for pos, (i, p) in enumerate(zip(indices, members, strict=True)):
                    views.append(flat[offset : offset + p.numel()].view(p.shape))
                    offset += int(p.numel())
                    self._where[i] = (b, pos)
                    if gradient_as_bucket_view and p.grad is not None:
                        views[-1].copy_(p.grad)
                        p.grad = views[-1]
                self._buckets.append(_Bucket(b, list(indices), flat, views))
        # Per-iteration state, reset by prepare_for_backward.
        self._expect_hooks = False
        self._ready = [False] * n
        self._used = [0] * n
        self._unused: list[int] = []
        self._next_bucket = 0
        self._finalize_queued = False
        self._used_future: Any = None
        self._used_tensor: Any = None
        self.timeline: dict[str, Any] = {}
        """Of the last synchronised backward (``time.perf_counter`` seconds): ``first_hook``,
        ``bucket_starts`` (one per bucket, in order), ``backward_end`` and ``grads_ready``."""
        ref = weakref.ref(self)
        self._handles = [
            p.register_post_accumulate_grad_hook(_make_hook(ref, i)) for i, p in enumerate(self._params)
        ]

    # -- introspection ------------------------------------------------------------------
    @property
    def bucket_indices(self) -> list[list[int]]:
        """Parameter indices (model order) of each bucket, in reduction order."""
        return [list(b.indices) for b in self._buckets]

    def remove_hooks(self) -> None:
        """Detach the reducer from the parameters (they keep their gradients)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        if not callable(hook):
            raise DistTypeError(f"hook must be callable, got {type(hook).__name__}")
        if self._hook is not None:
            raise DistValueError("register_comm_hook can only be called once")
        self._hook, self._hook_state = hook, state

    # -- iteration ----------------------------------------------------------------------
    def prepare_for_backward(self, outputs: Sequence[Any] | None) -> None:
        """Arm the hooks for the backward of the forward that just ran (called by DDP.forward)."""
        self._expect_hooks = True
        n = len(self._params)
        self._ready = [False] * n
        self._used = [0] * n
        self._next_bucket = 0
        self._finalize_queued = False
        self._used_future = None
        for b in self._buckets:
            b.pending = len(b.indices)
            b.future = None
        self._unused = []
        if self._find_unused and outputs is not None:
            reached = _reachable_leaves(outputs)
            self._unused = [i for i, p in enumerate(self._params) if id(p) not in reached]

    def _on_grad(self, index: int) -> None:
        """Post-accumulate-grad hook of parameter ``index`` (autograd thread)."""
        if not self._expect_hooks:
            return  # a backward under no_sync(), or a second backward of one forward
        if not self._finalize_queued:
            self._finalize_queued = True
            self.timeline = {"first_hook": time.perf_counter(), "bucket_starts": []}
            _queue_engine_callback(self._finalize)
            for i in self._unused:
                self._mark_ready(i)
        self._used[index] = 1
        self._mark_ready(index)

    def _mark_ready(self, index: int) -> None:
        if self._ready[index]:
            raise DistError(
                f"DistributedDataParallel on rank {self._group.global_rank}: parameter "
                f"{self._names[index]!r} got its gradient twice in one backward pass (a parameter "
                "reached by a path find_unused_parameters did not see, or a reentrant backward); "
                "gradients cannot be synchronised"
            )
        self._ready[index] = True
        b, pos = self._where[index]
        bucket = self._buckets[b]
        view = bucket.views[pos]
        param = self._params[index]
        grad = param.grad
        hooked = self._hook is not None
        if grad is None:
            view.zero_()
        elif self._as_view and grad.data_ptr() == view.data_ptr() and grad.shape == view.shape:
            if not hooked:
                view.mul_(self._scale)
        else:
            if hooked:
                view.copy_(grad)
            else:
                torch.mul(grad, self._scale, out=view)  # divide while copying: one pass
            if self._as_view:
                param.grad = view
        bucket.pending -= 1
        if bucket.pending == 0:
            self._start_ready_buckets()

    def _start_ready_buckets(self) -> None:
        """Start every full bucket whose predecessors have started (same order on every rank)."""
        buckets = self._buckets
        while self._next_bucket < len(buckets) and buckets[self._next_bucket].pending == 0:
            bucket = buckets[self._next_bucket]
            self._next_bucket += 1
            self.timeline["bucket_starts"].append(time.perf_counter())
            if self._hook is None:
                bucket.future = _comm.all_reduce_future(bucket.flat, self._group)
            else:
                grad_bucket = GradBucket(
                    bucket.index,
                    bucket.flat,
                    [self._params[i] for i in bucket.indices],
                    list(bucket.views),
                    bucket.index == len(buckets) - 1,
                )
                bucket.future = self._hook(self._hook_state, grad_bucket)
        if self._next_bucket == len(buckets) and self._find_unused and self._used_future is None:
            # Which parameters some rank used: a rank that skipped one must still take the average.
            self._used_tensor = torch.tensor(self._used, dtype=torch.int32)
            self._used_future = _comm.all_reduce_future(self._used_tensor, self._group)

    def _finalize(self) -> None:
        """End of backward (autograd engine callback): wait for every bucket, write the grads."""
        self._expect_hooks = False
        self.timeline["backward_end"] = time.perf_counter()
        if self._next_bucket < len(self._buckets):
            missing = [i for i, ready in enumerate(self._ready) if not ready]
            names = ", ".join(repr(self._names[i]) for i in missing)
            raise DistError(
                f"DistributedDataParallel on rank {self._group.global_rank}: these parameters did "
                f"not receive a gradient in this backward pass: {names} (indices "
                f"{', '.join(map(str, missing))}). They were not used in producing the loss: pass "
                "find_unused_parameters=True to DistributedDataParallel, and make sure every output "
                "of forward takes part in the loss. Gradients were not synchronised in this iteration."
            )
        globally_used: list[int] | None = None
        if self._used_future is not None:
            self._used_future.wait()
            globally_used = [int(v) for v in self._used_tensor.tolist()]
        with torch.no_grad():
            for bucket in self._buckets:
                result = _wait_value(bucket.future, bucket)
                if result is not bucket.flat:
                    bucket.flat.copy_(result.reshape(-1))
                for pos, i in enumerate(bucket.indices):
                    if globally_used is not None and not globally_used[i]:
                        continue  # no rank used it: its grad stays as it was, as in torch
                    view = bucket.views[pos]
                    param = self._params[i]
                    if self._as_view:
                        if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                            param.grad = view
                    elif param.grad is None:
                        param.grad = view.clone()
                    else:
                        param.grad.copy_(view)
                bucket.future = None
        self.timeline["grads_ready"] = time.perf_counter()


def _make_hook(ref: weakref.ref[Reducer], index: int) -> Callable[[Any], None]:
    def hook(_param: Any) -> None:
        reducer = ref()
        if reducer is not None:
            reducer._on_grad(index)

    return hook


def _describe(named: Sequence[tuple[str, Any]]) -> list[list[Any]]:
    return [[name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in named]


def _verify(tables: list[Any], group: ProcessGroup) -> None:
    """Raise, on every rank alike, unless all ranks describe the same module as group rank 0."""
    ranks = group.ranks
    kinds = (
        ("params", "parameters requiring grad", "parameter"),
        ("state", "parameters and buffers", "tensor"),
    )
    for kind, label, one in kinds:
        ref = tables[0][kind]
        for g, table in enumerate(tables[1:], start=1):
            mine = table[kind]
            if len(mine) != len(ref):
                counts = ", ".join(f"rank {ranks[k]} has {len(t[kind])}" for k, t in enumerate(tables))
                extra_here = [e[0] for e in mine if e[0] not in {r[0] for r in ref}]
                extra_there = [e[0] for e in ref if e[0] not in {m[0] for m in mine}]
                detail = []
                if extra_here:
                    detail.append(
                        f"rank {ranks[g]} has {', '.join(map(repr, extra_here))} which rank {ranks[0]} lacks"
                    )
                if extra_there:
                    detail.append(
                        f"rank {ranks[0]} has {', '.join(map(repr, extra_there))} which rank {ranks[g]} lacks"
                    )
                raise DistValueError(
                    f"DistributedDataParallel: ranks disagree on the number of {label}: {counts}"
                    + (f" ({'; '.join(detail)})" if detail else "")
                )
            for k, (a, b) in enumerate(zip(ref, mine, strict=True)):
                if a[1:] != b[1:]:
                    other = "" if a[0] == b[0] else f" (there named {b[0]!r})"
                    raise DistValueError(
                        f"DistributedDataParallel: {one} {a[0]!r} (index {k}) has shape {tuple(a[1])} and "
                        f"dtype {a[2]} on rank {ranks[0]}, but shape {tuple(b[1])} and dtype {b[2]} on "
                        f"rank {ranks[g]}{other}"
                    )


class DistributedDataParallel(torch.nn.Module):
    """Data parallelism: keeps replicas of ``module`` equal by averaging gradients across ranks.

    Wrap the model after ``init_process_group``; run forward through the wrapper and call
    ``loss.backward()`` as usual: when it returns, every ``param.grad`` holds the average over
    the group. Use it from a thread other than the runtime loop's (the sync face, or a worker
    thread of an asyncio program).

    Args:
        module: the model (CPU tensors).
        process_group: the group to average over (None: the default group).
        bucket_cap_mb: cap of each gradient bucket after the first one (1 MiB); None means 25.
        broadcast_buffers: before each forward that will synchronise gradients, overwrite the
            module's buffers (BatchNorm statistics...) with rank 0's.
        find_unused_parameters: tolerate parameters that some forward does not use (walks the
            autograd graph after each forward). Without it such a parameter makes backward raise
            ``DistError`` naming it.
        gradient_as_bucket_view: ``param.grad`` stays a view into its bucket (saves a copy and
            the memory of the gradients).
        device_ids, output_device, dim: accepted for torch compatibility; CPU modules only.

    Raises:
        DistValueError: the ranks' modules differ (the message names the parameter and ranks,
            or gives each rank's count), or a parameter expects sparse gradients.
        DistTimeoutError: some ranks did not construct within the group's timeout ("rank k did
            not arrive").
        DistError: constructed on the runtime's event-loop thread.
    """

    def __init__(
        self,
        module: Any,
        process_group: Any = None,
        bucket_cap_mb: float | None = 25,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        *,
        device_ids: Sequence[Any] | None = None,
        output_device: Any = None,
        dim: int = 0,
    ) -> None:
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise DistTypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if device_ids and any(str(d) not in ("cpu", "-1") for d in device_ids):
            raise DistValueError(f"device_ids={list(device_ids)}: aiodist's DDP supports CPU modules only")
        group = resolve_group(process_group)
        group.check_usable("DistributedDataParallel")
        self.module = module
        self.process_group = group
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.bucket_cap_mb = 25.0 if bucket_cap_mb is None else float(bucket_cap_mb)
        self.dim = dim
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))

        params, names, seen = [], [], set()
        for mname, sub in module.named_modules():
            for pname, p in sub.named_parameters(recurse=False):
                full = f"{mname}.{pname}" if mname else pname
                if not p.requires_grad or full in ignore or id(p) in seen:
                    continue
                if isinstance(sub, torch.nn.Embedding | torch.nn.EmbeddingBag) and sub.sparse:
                    raise DistValueError(
                        f"parameter {full!r}: sparse gradients are not supported by aiodist's DistributedDataParallel"
                    )
                seen.add(id(p))
                params.append(p)
                names.append(full)
        if not params:
            raise DistValueError(
                "DistributedDataParallel is not needed when a module has no parameter that requires a gradient"
            )
        state: list[tuple[str, Any]] = []
        seen_state: set[int] = set()
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if name not in ignore and id(t) not in seen_state:
                seen_state.add(id(t))
                state.append((name, t))
        self._buffer_names = {name for name, _ in module.named_buffers()} - ignore
        description = {
            "params": _describe(list(zip(names, params, strict=True))),
            "state": _describe(state),
        }
        payload = msgpack.packb(description, use_bin_type=True)
        src = group.ranks[0]

        async def construct() -> None:
            raw = await _comm.exchange_bytes(group, payload, "DistributedDataParallel construction")
            _verify([msgpack.unpackb(r, raw=False) for r in raw], group)
            await _comm.broadcast_coalesced([t for _, t in state], group, src)

        _comm.run_blocking(group, construct, "DistributedDataParallel construction")
        self.reducer = Reducer(
            params, names, group, self.bucket_cap_mb, find_unused_parameters, gradient_as_bucket_view
        )

    # -- training -------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        grad_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self.require_forward_param_sync and self.broadcast_buffers:
            self._sync_buffers()
        output = self.module(*inputs, **kwargs)
        if grad_sync:
            self.require_forward_param_sync = True
            outputs = list(_find_tensors(output)) if self.find_unused_parameters else None
            self.reducer.prepare_for_backward(outputs)
        else:
            # As torch: buffers are not synchronised before the forward after a no_sync one.
            self.require_forward_param_sync = False
        return output

    def _sync_buffers(self) -> None:
        group = self.process_group
        if group.size == 1:
            return
        buffers = [t for name, t in self.module.named_buffers() if name in self._buffer_names]
        if not buffers:
            return
        src = group.ranks[0]
        _comm.run_blocking(
            group,
            lambda: _comm.broadcast_coalesced(buffers, group, src),
            "DistributedDataParallel buffer sync",
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient synchronisation for forwards run inside; gradients accumulate locally.

        The first forward-backward after the block averages the accumulated gradients.
        """
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce buckets with ``hook(state, bucket) -> torch.futures.Future`` instead of all_reduce.

        The hook sees each bucket's undivided gradients (``bucket.buffer()``) and returns a future
        of the reduced tensor; see ``aiodist.parallel.hooks``. It runs on the autograd thread, in
        bucket order; it may be registered once, before training.
        """
        self.reducer.register_comm_hook(state, hook)

    @property
    def bucket_indices(self) -> list[list[int]]:
        """Parameter indices of each gradient bucket, in the order buckets are reduced."""
        return self.reducer.bucket_indices
