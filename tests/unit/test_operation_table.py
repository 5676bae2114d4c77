"""The operation table (``aiodist.operations``): every tensor collective declared once, and few
places to touch to add one.

An entry of the table is declared in three modules: the table itself (its check and how the
blocking face shows it to torch's profiler) and one declaration on each face, whose body runs
the entry by name. Its kind of collective is planned from ``KINDS`` in the same table module
and carried out by its algorithm under ``collectives/``. These tests hold the faces to the
table, and read the source for where each operation is named, so that a change which spreads
an operation over more modules fails here.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import aiodist
import aiodist.sync
from aiodist.operations import KINDS, TABLE

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2] / "aiodist"

#: Where an operation is declared: the table, the async face, the blocking face.
DECLARED_IN = {"operations.py", "face/tensor_collectives.py", "sync/_collectives.py"}
#: The modules of a host-aware form (an extension of a kind that has one).
HOST_AWARE = {"collectives/hostaware.py", "collectives/hierarchical.py", "collectives/select.py"}
#: Modules built on other operations, naming them as a caller does (object collectives run the
#: broadcast and all_gather kinds; the blocking face's coalesced calls and complex check name
#: what they run), and torch's layer: torch's engines translate the kinds they run (refusing
#: the others), torch's backend offers what torch's Backend class declares.
CALLERS = {"face/object_collectives.py", "sync/_coalesced.py", "sync/_core.py", "backends/torch_engine.py"}
OUTSIDE = ("torch/", "bench/")


def _params_before(fn: object, stop: str) -> list[str]:
    names = list(inspect.signature(fn).parameters)  # type: ignore[arg-type]
    return names[: names.index(stop)] if stop in names else names


@pytest.mark.parametrize("name", sorted(TABLE))
def test_every_entry_is_declared_on_both_faces_with_the_checks_arguments(name: str) -> None:
    """Both faces take the check's arguments in its order, and the async face its defaults
    (``group.collective("all_reduce", t)`` sums, as ``aiodist.all_reduce(t)`` does)."""
    check = list(inspect.signature(TABLE[name].check).parameters.values())[2:]  # (after group, binding)
    names = [p.name for p in check]
    assert name in aiodist.__all__ and name in aiodist.sync.__all__
    assert _params_before(getattr(aiodist, name), "group") == names
    assert _params_before(getattr(aiodist.sync, name), "group") == names
    face = inspect.signature(getattr(aiodist, name)).parameters
    assert [face[p.name].default for p in check] == [p.default for p in check]


@pytest.mark.parametrize("name", sorted(TABLE))
def test_an_entry_names_the_tensors_its_faces_stage(name: str) -> None:
    entry = TABLE[name]
    check_args = list(inspect.signature(entry.check).parameters)[2:]
    assert 0 <= entry.tensors <= len(check_args)
    assert entry.shown is None or 0 <= entry.shown < entry.tensors


def _modules_naming() -> dict[str, set[str]]:
    """For each entry, the modules of aiodist naming it in code: a function of that name or a
    string equal to it, not a docstring and not the name passed to ``collective`` /
    ``run_entry`` (a face running its entry, or a caller running an operation)."""
    named: dict[str, set[str]] = {name: set() for name in TABLE}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(OUTSIDE):
            continue
        tree = ast.parse(path.read_text())
        skipped: set[int] = set()
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            first = body[0] if isinstance(body, list) and body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                skipped.add(id(first.value))  # a docstring
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if called in ("collective", "run_entry"):
                    skipped.add(id(node.args[0]))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skipped:
                word = node.value
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                word = node.name
            else:
                continue
            if word in named:
                named[word].add(rel)
    return named


NAMED = _modules_naming()


@pytest.mark.parametrize("name", sorted(TABLE))
def test_an_operation_lives_in_its_declarations_and_its_algorithm(name: str) -> None:
    """To add an operation is to touch at most 4 modules: its three declarations and, for a new
    kind of collective, its algorithm (a host-aware form extends the host-aware modules)."""
    touched = NAMED[name] - CALLERS
    kind = KINDS.get(name)
    if kind is not None and kind.host is not None:
        touched -= HOST_AWARE
    assert touched >= DECLARED_IN, f"{name} is not declared in {sorted(DECLARED_IN - touched)}"
    beyond = touched - DECLARED_IN
    assert all(m.startswith("collectives/") for m in beyond), f"{name} is also named in {sorted(beyond)}"
    assert len(touched) <= 4, f"{name} is named in {len(touched)} modules: {sorted(touched)}"


def test_an_operation_over_an_existing_kind_is_three_declarations() -> None:
    """``reduce_scatter_tensor`` is a ``reduce_scatter`` of its input's blocks: nothing but its
    declarations names it (outside torch's layer and the benchmarks)."""
    over_kinds = sorted(name for name in TABLE if name not in KINDS)
    assert over_kinds == ["all_gather_into_tensor", "all_to_all_single", "reduce_scatter_tensor"]
    for name in over_kinds:
        assert NAMED[name] - CALLERS == DECLARED_IN, name


def test_the_reader_finds_a_name_where_it_is_code() -> None:
    """The source reader counts a string key and a function name, and skips docstrings and the
    names a face runs by (without which the counts above could not fail)."""
    assert "operations.py" in NAMED["all_to_all_single"]  # the check's function name
    assert "operations.py" in NAMED["all_to_all"]  # the kind's key in KINDS
    assert "collectives/select.py" in NAMED["all_reduce"]  # a string in a set of kinds
    # named in a docstring only, and as the operation a caller runs:
    assert "all_gather_into_tensor" in (ROOT / "backends/base.py").read_text()
    assert "backends/base.py" not in NAMED["all_gather_into_tensor"]
    assert 'collective("all_reduce"' in (ROOT / "parallel/_comm.py").read_text()
    assert "parallel/_comm.py" not in NAMED["all_reduce"]
