"""A group's and a Work's internals stay in their modules: other code goes through their interfaces.

Recovery (resync, timeouts, failure) reads and changes a group through ``ProcessGroup.next_seq``,
``settled_below``, ``in_flight``, ``fail_op``, ``give_up_op`` and ``restart_numbering``; the faces,
DDP and the torch adapter reach a Work's future through ``aiodist.work.future_of``,
``take_outcome``, ``discard`` and ``note_start``. This check fails when code elsewhere in the
package touches one of their private fields or methods again.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "aiodist"

# Accesses that look alike but are not: another class's member of the same name.
NOT_THEIRS = {
    ("torch/_adapter.py", "_fail"): "the C++ extension's Work (AiodistWork::_fail), not the group's",
}


def _privates(path: Path, cls: str) -> set[str]:
    """The private names ``cls`` defines: its ``_methods`` and the ``self._fields`` it sets or reads."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for sub in ast.walk(node):
                if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(sub.name)
                elif (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                ):
                    names.add(sub.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _touches(path: Path, names: set[str]) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        on_itself = (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        )
        if isinstance(node, ast.Attribute) and node.attr in names and not on_itself:
            found.append((node.lineno, ast.unparse(node)))
    return found


@pytest.mark.parametrize(("module", "cls"), [("group.py", "ProcessGroup"), ("work.py", "Work")])
def test_internals_stay_in_their_module(module: str, cls: str) -> None:
    names = _privates(ROOT / module, cls)
    assert len(names) > 3, "the check found no private names: it would pass whatever the code does"
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == module:
            continue
        for line, text in _touches(path, names):
            if (rel, text.rpartition(".")[2]) not in NOT_THEIRS:
                found.append(f"aiodist/{rel}:{line} {text}")
    assert not found, f"{cls}'s internals used outside {module}: " + ", ".join(found)


def test_the_check_sees_an_access(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("def f(g):\n    return g._seq + g.next_seq\n")
    assert _touches(sample, {"_seq"}) == [(2, "g._seq")]
