"""Communication hooks for ``DistributedDataParallel.register_comm_hook`` (needs torch).

A hook is ``hook(state, bucket) -> torch.futures.Future``: it gets a ``GradBucket`` whose
``buffer()`` holds the bucket's gradients, not yet divided by the world size, starts the
reduction and returns a future of the reduced flat tensor. Here ``state`` is the process group
(None: the default group), as for torch's ``default_hooks``::

    ddp.register_comm_hook(None, hooks.fp16_compress_hook)

Hooks run on the autograd thread; the futures they return complete on the runtime loop's
thread, where ``then`` callbacks run too. ``work_future`` turns an aiodist ``Work`` into a torch
future, for hooks written against ``aiodist.sync`` (``dist.all_reduce(t, async_op=True)``).
"""

from __future__ import annotations

from typing import Any

import torch

from aiodist.face.world import resolve_group
from aiodist.parallel._comm import all_reduce_future
from aiodist.work import Work

__all__ = ["allreduce_hook", "bf16_compress_hook", "fp16_compress_hook", "work_future"]


def allreduce_hook(process_group: Any, bucket: Any) -> Any:
    """Average the bucket with one all_reduce (what DDP does without a hook).

    Returns:
        A ``torch.futures.Future`` of ``bucket.buffer()`` holding the average.
    """
    group = resolve_group(process_group)
    tensor = bucket.buffer().div_(group.size)
    return all_reduce_future(tensor, group)


def fp16_compress_hook(process_group: Any, bucket: Any) -> Any:
    """Average in float16: halves the bytes sent; the result is cast back into the bucket."""
    return _compressed(process_group, bucket, torch.float16)


def bf16_compress_hook(process_group: Any, bucket: Any) -> Any:
    """Average in bfloat16 (float32's range, 8 bits of mantissa); cast back into the bucket."""
    return _compressed(process_group, bucket, torch.bfloat16)


def _compressed(process_group: Any, bucket: Any, dtype: Any) -> Any:
    group = resolve_group(process_group)
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(group.size)

    def decompress(fut: Any) -> Any:
        buffer.copy_(fut.value())
        return buffer

    return all_reduce_future(compressed, group).then(decompress)


def work_future(work: Work, value: Any = None) -> Any:
    """A ``torch.futures.Future`` completing with ``value`` when ``work`` does (or with its error).

    Example: ``return work_future(dist.all_reduce(t, async_op=True), t)`` in a hook written
    for ``aiodist.sync``.
    """
    fut: Any = torch.futures.Future()

    def settle(done: Any) -> None:
        exc = done.exception()
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)

    work.get_future().add_done_callback(settle)
    return fut
