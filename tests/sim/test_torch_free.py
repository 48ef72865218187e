"""The simulator runs without torch: a whole simulated run must never import it."""

from __future__ import annotations

import subprocess
import sys

RUN_WITHOUT_TORCH = """
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
        return None

sys.meta_path.insert(0, Block())
import pkgutil, splitserve.sim as s
for m in pkgutil.walk_packages(s.__path__, "splitserve.sim."):
    __import__(m.name)
from splitserve.cli import main
assert main(["sim", "--rate", "2", "--duration", "3", "--prefill", "1", "--decode", "1"]) == 0
assert "torch" not in sys.modules
print("ok")
"""


def test_a_simulated_run_never_imports_torch():
    out = subprocess.run(
        [sys.executable, "-c", RUN_WITHOUT_TORCH], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")
