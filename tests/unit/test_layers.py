"""Imports only point down: no module of aiodist imports one from a layer above its own.

The table below is the layering (lowest first); docs/development.md shows it to readers ("Layout and
layers", checked against this one below). A module
belongs to the layer of the longest prefix naming it. Modules of one layer may import each other.
Every import counts, including those inside functions and under ``TYPE_CHECKING``: a lazy import
hides a dependency, it does not remove it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "aiodist"

# Lowest first. The table of docs/development.md ("Layout and layers") must name the same modules per layer.
LAYERS: list[tuple[str, ...]] = [
    ("aiodist.errors",),
    ("aiodist.ops", "aiodist._docs", "aiodist.settings", "aiodist.native", "aiodist.wire", "aiodist.runtime"),
    ("aiodist._tensors", "aiodist.work", "aiodist.store"),
    ("aiodist.transport",),
    ("aiodist.collectives",),
    # The group and what it runs its operations on (it holds a Backend; backends start the
    # group's numbered operations): one layer.
    ("aiodist.group", "aiodist._inflight", "aiodist.operations", "aiodist._recovery", "aiodist.backends"),
    ("aiodist.rendezvous",),
    ("aiodist.job",),
    ("aiodist.face", "aiodist"),  # "aiodist": the package itself, the async face's names
    ("aiodist.testing",),
    # aiodist as a torch backend sits on the async face; the sync face stands on it, as its
    # init gives torch.distributed the same default group on the "aiodist" backend.
    ("aiodist.torch",),
    ("aiodist.sync",),
    ("aiodist.parallel",),
    # Tools on top of everything: the launchers and the benchmarks (the DDP step benchmark lives
    # beside DDP and compares it with torch's DDP on the "aiodist" backend, so it sits up here).
    (
        "aiodist._launcher",
        "aiodist.bench",
        "aiodist.run",
        "aiodist.launch",
        "aiodist.parallel.bench_ddp",
        "aiodist.torch.bench",
    ),
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def layer_of(module: str) -> int:
    """The layer of ``module``: that of the longest table prefix naming it."""
    best, best_len = -1, -1
    for level, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = level, len(prefix)
    if best < 0:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return best


def imports_of(module: str, path: Path) -> list[tuple[str, int]]:
    """The aiodist modules ``module`` imports, with the line of each import."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "aiodist"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                kept = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(kept + ([node.module] if node.module else []))
            if base.split(".")[0] != "aiodist":
                continue
            for alias in node.names:
                # ``from aiodist import _tensors`` imports a module; ``from aiodist import Work``
                # imports a name of the package.
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in MODULES else base, node.lineno))
    return found


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module: str) -> None:
    own = layer_of(module)
    upward = [
        f"{module}:{line} imports {target} (layer {layer_of(target)} > {own})"
        for target, line in imports_of(module, MODULES[module])
        if layer_of(target) > own
    ]
    assert not upward, "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The walker finds an import inside a function (the form upward imports used to hide in)."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from aiodist.sync._bridge import call\n    return call\n")
    assert imports_of("aiodist.runtime.probe", probe) == [("aiodist.sync._bridge", 2)]
    assert layer_of("aiodist.sync._bridge") > layer_of("aiodist.runtime.probe")


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules that import each other in a loop (strongly connected, more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            circle = []
            while True:
                w = stack.pop()
                circle.append(w)
                if w == v:
                    break
            if len(circle) > 1:
                circles.append(sorted(circle))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circle() -> None:
    """Modules of one layer may import each other, but never in a loop: a part that imports what
    imports it cannot be read, tested or replaced alone (a protocol of its own breaks such a loop)."""
    graph = {m: {t for t, _ in imports_of(m, p) if t in MODULES and t != m} for m, p in MODULES.items()}
    assert import_circles(graph) == []


def test_the_circle_check_finds_a_circle() -> None:
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        layer_of(module)


def _readme_layers() -> list[set[str]]:
    """The modules each row of the layer table of docs/development.md names, lowest layer first."""
    text = (ROOT.parent / "docs" / "development.md").read_text(encoding="utf-8")
    table = text[text.index("| layer | modules | what it may use |") :].split("\n\n", 1)[0]
    rows = []
    for line in table.splitlines()[2:]:
        cells = line.split("|")
        names = set()
        for token in cells[2].split("`")[1::2]:
            name = token.rstrip("/").replace("/", ".")
            names.add("aiodist" if token == "aiodist" else f"aiodist.{name}")
        rows.append(names)
    return rows


def test_the_readme_table_is_this_table() -> None:
    assert _readme_layers() == [set(layer) for layer in LAYERS]
