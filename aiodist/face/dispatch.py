"""``@routed``: the one hook between the async face's tensor operations and what lies beside
the algorithms.

Each tensor operation of ``_collectives`` and ``_p2p`` is decorated with the roles of its
tensor arguments. A call then goes, in this order:

1. to the torch engine of its group (``group.engine``, backends "nccl" and "torch-gloo",
   ``aiodist.backends.torch_engine``): the engine's method of the same name and signature;
2. staged through host buffers (``aiodist.backends.staged.call_staged``) when it holds a CUDA tensor
   (the tensor layer raises ``DeviceTensorError``, caught here, before the operation took a
   sequence number) or when the group's stager stages host tensors too (tests);
3. otherwise to the function itself. This common path costs one group lookup and a ``try``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, cast

from aiodist._tensors import DeviceTensorError
from aiodist.backends.staged import Role, call_staged
from aiodist.face.world import resolve_group
from aiodist.work import Work

__all__ = ["routed"]

F = TypeVar("F", bound=Callable[..., Work])


def routed(*, sends: bool = False, **roles: Role) -> Callable[[F], F]:
    """Decorate an operation whose parameters include ``group``.

    Args:
        sends: the operation queues its bytes at once (a send).
        roles: ``name=IN | OUT | INOUT`` for each tensor or tensor-list parameter.
    """

    def decorate(fn: F) -> F:
        signature = inspect.signature(fn)
        params = list(signature.parameters)
        at = params.index("group")
        name = fn.__name__

        @functools.wraps(fn)
        def operation(*args: Any, **kwargs: Any) -> Work:
            g = resolve_group(args[at] if len(args) > at else kwargs.get("group"))
            if g.engine is not None:
                return cast(Work, getattr(g.engine, name)(*args, **kwargs))
            stager = g.stager
            if stager is not None and stager.stages_host_tensors:
                return call_staged(stager, g.loop, fn, signature, roles, sends, args, kwargs)
            try:
                return fn(*args, **kwargs)
            except DeviceTensorError:
                if stager is None:
                    raise
            return call_staged(stager, g.loop, fn, signature, roles, sends, args, kwargs)

        return cast(F, operation)

    return decorate
