"""The packages of ``splitserve`` form layers that import only downward, and no modules import
each other in a circle.

Every ``import`` in ``src/splitserve`` counts, wherever it stands: at the top, inside a
function (a lazy import) or under ``TYPE_CHECKING``; each is a dependency a reader must hold
in mind. Packages in one layer are peers: neither imports the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "(top)"  # splitserve/__init__.py and the command-line modules beside it (cli.py...)

# Bottom first. A package may import only the packages of the layers below its own.
LAYERS: list[set[str]] = [
    {"common"},
    {"config"},
    {"workload", "models", "router"},
    {"kvstore"},
    {"engine"},
    {"transfer", "entrypoints"},
    {"sim"},
    {"worker", "cluster"},
    {"bench"},
    {ROOT},
]
RANK = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def modules(src: Path = SRC) -> dict[str, Path]:
    """Every module of ``splitserve`` by dotted name (a package by its ``__init__``)."""
    out = {}
    for path in sorted((src / "splitserve").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The ``splitserve`` modules that module ``name`` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)  # a submodule, or a name in base
    return {m for m in found if m in known and m != name}


def package_of(module: str) -> str:
    """A module's layer name: its package under ``splitserve``; ``config`` for
    ``splitserve/config.py``; ``ROOT`` for the other modules beside it."""
    parts = module.split(".")
    if len(parts) == 1 or (len(parts) == 2 and parts[1] != "config" and parts[1] not in RANK):
        return ROOT
    return parts[1]


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def upward_arrows(edges: dict[str, set[str]]) -> list[str]:
    out = []
    for a, targets in edges.items():
        for b in sorted(targets):
            pa, pb = package_of(a), package_of(b)
            if pa != pb and RANK[pb] >= RANK[pa]:
                out.append(f"{a} -> {b} ({pa} may not import {pb})")
    return sorted(out)


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_package_has_a_layer():
    assert {package_of(m) for m in modules()} == set(RANK)


def test_no_package_imports_upward():
    assert upward_arrows(graph()) == []


def test_no_modules_import_each_other_in_a_circle():
    assert circles(graph()) == []


def test_the_checks_see_an_upward_arrow_a_circle_and_every_kind_of_import(tmp_path):
    pkg = tmp_path / "splitserve"
    for sub in ("common", "engine"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "common" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from splitserve.engine import b\n"
    )
    (pkg / "engine" / "b.py").write_text("def f():\n    from ..common.a import x\n")
    known = modules(tmp_path)
    edges = {n: imports(n, p, known) for n, p in known.items()}
    assert edges["splitserve.common.a"] == {"splitserve.engine.b"}
    assert edges["splitserve.engine.b"] == {"splitserve.common.a"}
    assert upward_arrows(edges) == [
        "splitserve.common.a -> splitserve.engine.b (common may not import engine)"
    ]
    assert circles(edges) == [["splitserve.common.a", "splitserve.engine.b"]]
