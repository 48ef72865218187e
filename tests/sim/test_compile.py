"""The mypyc build's guard: a compiled tree built from older sources is refused.

Compiling takes minutes, so these tests check the manifest logic on a tree they lay out
themselves; that the compiled modules compute the same results is checked by running
``benchmarks/sim_fingerprint.py`` and ``tests/sim`` against the build (docs/simulator.md).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_sim_compile():
    spec = importlib.util.spec_from_file_location("sim_compile", BENCHMARKS / "sim_compile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_manifest(sc, tree: Path, digests: dict[str, str]) -> None:
    lines = [f"{digests.get(m, sc.digest(sc.SRC / m))}  {m}" for m in sc.MODULES]
    (tree / sc.MANIFEST).write_text("\n".join(lines) + "\n")


def test_a_tree_built_from_the_current_sources_is_fresh(tmp_path):
    sc = load_sim_compile()
    write_manifest(sc, tmp_path, {})
    assert sc.stale_sources(tmp_path) == []


def test_a_changed_source_makes_its_module_stale(tmp_path):
    sc = load_sim_compile()
    write_manifest(sc, tmp_path, {"splitserve/sim/engine.py": "0" * 64})
    assert sc.stale_sources(tmp_path) == ["splitserve/sim/engine.py"]


def test_a_tree_without_manifest_is_all_stale(tmp_path):
    sc = load_sim_compile()
    assert sc.stale_sources(tmp_path) == sc.MODULES


def test_every_compiled_module_exists():
    sc = load_sim_compile()
    for module in sc.MODULES:
        assert (sc.SRC / module).is_file(), module


def test_sim_scale_refuses_a_stale_build(tmp_path):
    """A clear message and exit status, not a run on the wrong code."""
    cmd = [sys.executable, str(BENCHMARKS / "sim_scale.py"), "--compiled", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "stale or missing" in out.stderr and "sim_compile.py" in out.stderr


def test_use_compiled_must_come_before_splitserve_is_imported(tmp_path):
    import splitserve  # noqa: F401

    sc = load_sim_compile()
    with pytest.raises(RuntimeError, match="before splitserve is imported"):
        sc.use_compiled(str(tmp_path))


def test_the_written_inits_are_in_compiled_modules():
    sc = load_sim_compile()
    assert set(sc.NATIVE_INITS) <= set(sc.MODULES)
