"""Every public function and class of both faces says what it does: ``help(aiodist.x)`` and
``help(aiodist.sync.x)`` show a docstring, and the operations state their whole contract."""

from __future__ import annotations

import inspect

import pytest

import aiodist
import aiodist.sync

# The tensor and object operations: their docstrings give the arguments, the result, the errors
# and what a timeout or a failure leaves behind.
OPERATIONS = [
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "recv_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send_object_list",
]
ASYNC_P2P = ["send", "recv", "isend", "irecv", "barrier"]


def _public(module: object) -> list[tuple[str, object]]:
    names = module.__all__  # type: ignore[attr-defined]
    objs = [(n, getattr(module, n)) for n in names]
    return [(n, o) for n, o in objs if inspect.isfunction(o) or inspect.isclass(o)]


@pytest.mark.parametrize("module", [aiodist, aiodist.sync], ids=["aiodist", "aiodist.sync"])
def test_every_public_function_and_class_has_a_docstring(module: object) -> None:
    public = _public(module)
    assert len(public) > 30  # the faces' operations, not an empty list
    missing = [n for n, o in public if not (inspect.getdoc(o) or "").strip()]
    assert missing == []


@pytest.mark.parametrize(
    ("module", "name"),
    [(aiodist, n) for n in OPERATIONS + ASYNC_P2P] + [(aiodist.sync, n) for n in OPERATIONS],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
def test_operations_state_their_contract(module: object, name: str) -> None:
    doc = inspect.getdoc(getattr(module, name)) or ""
    for section in ("Args:", "Returns:", "Raises:", "DistTimeoutError", "timeout"):
        assert section in doc, (name, section)
    # what a timeout leaves behind
    assert "partial data" in doc, name


def test_sync_operations_keep_their_signature_for_help() -> None:
    # torch_op wraps each operation; help() and inspect still show torch's signature.
    sig = inspect.signature(aiodist.sync.broadcast)
    assert list(sig.parameters) == ["tensor", "src", "group", "async_op", "group_src"]
