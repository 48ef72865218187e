"""Every script under ``benchmarks/`` runs from a ``make`` target, or is a module that such a
script imports (``router_load``, ``agent_schemas``...): nothing there is left for a reader to
discover by hand."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def make_commands() -> str:
    """The Makefile's recipe and variable lines, without its comments."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith("#"))


def local_imports(script: Path) -> set[str]:
    """The names of ``benchmarks/`` modules that ``script`` imports."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return {n for n in names if (BENCHMARKS / f"{n}.py").is_file()}


def test_every_benchmark_script_is_reachable_from_a_make_target() -> None:
    commands = make_commands()
    named = set(re.findall(r"benchmarks/([\w.]+\.(?:py|sh))", commands))
    reached, todo = set(named), [BENCHMARKS / n for n in named if n.endswith(".py")]
    while todo:
        for module in local_imports(todo.pop()):
            if f"{module}.py" not in reached:
                reached.add(f"{module}.py")
                todo.append(BENCHMARKS / f"{module}.py")
    scripts = {p.name for p in BENCHMARKS.iterdir() if p.suffix in (".py", ".sh")}
    assert scripts - reached == set()
    assert named <= scripts, "a make target names a script that does not exist"
