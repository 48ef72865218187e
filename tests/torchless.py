"""Run code in a fresh interpreter that can import only what an install of splitserve with
some extras would have (``pip install 'splitserve[router]'``), for the parts of the project
that must deploy without the engine's packages (router, simulator).

The packages are the extras' requirements in ``pyproject.toml`` and theirs, recursively, as
installed here; every other installed distribution's modules fail to import, as they would
on a machine without them.
"""

from __future__ import annotations

import importlib.metadata as metadata
import subprocess
import sys
import tomllib
from collections.abc import Iterable, Sequence
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"

_BLOCK = """
import importlib.abc, sys

BLOCKED = {blocked!r}

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"{{name}} is not in the install under test", name=name)
        return None

sys.meta_path.insert(0, Block())
STARTUP = set(sys.modules)  # what the interpreter's start imported (site's .pth hooks)
"""

_CHECK = """
assert not BLOCKED & {m.partition(".")[0] for m in set(sys.modules) - STARTUP}
print("ok")
"""

ENGINE_MODULES = ("torch", "numba", "matplotlib", "transformers", "gguf", "safetensors")


def distributions(extras: Iterable[str]) -> set[str]:
    """The distributions ``pip install 'splitserve[extras]'`` installs, by canonical name."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        wanted += [Requirement(r) for r in project["optional-dependencies"][extra]]
    found: set[str] = set()
    while wanted:
        req = wanted.pop()
        name = canonicalize_name(req.name)
        if name == "splitserve":  # an extra naming others: splitserve[a,b]
            for extra in req.extras:
                wanted += [Requirement(r) for r in project["optional-dependencies"][extra]]
            continue
        if name in found:
            continue
        found.add(name)
        for text in metadata.requires(req.name) or []:
            sub = Requirement(text)
            envs = [{"extra": e} for e in ("", *req.extras)]
            if sub.marker is None or any(sub.marker.evaluate(env) for env in envs):
                wanted.append(sub)
    return found


def blocked_modules(extras: Iterable[str]) -> set[str]:
    """The top-level modules of installed distributions the extras do not bring."""
    keep = distributions(extras)
    owners = metadata.packages_distributions()
    return {
        top
        for top, dists in owners.items()
        if top not in sys.stdlib_module_names
        and top != "splitserve"
        and not any(canonicalize_name(d) in keep for d in dists)
    }


def run_with_extras(extras: Sequence[str], code: str, timeout: float) -> set[str]:
    """Run ``code`` as it would run on an install with only ``extras``; fail if it errs or
    a module outside them got imported anyway. Returns the blocked modules."""
    blocked = blocked_modules(extras)
    out = subprocess.run(
        [sys.executable, "-c", _BLOCK.format(blocked=blocked) + code + _CHECK],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")
    return blocked


def run_without_torch(code: str, timeout: float) -> None:
    """Run ``code`` with only the router's and the simulator's extras installed."""
    blocked = run_with_extras(["router", "sim"], code, timeout)
    assert set(ENGINE_MODULES) <= blocked
