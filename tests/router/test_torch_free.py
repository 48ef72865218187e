"""The router deploys without torch: importing all of it must never import torch."""

from __future__ import annotations

import subprocess
import sys

BLOCK_TORCH = """
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
        return None

sys.meta_path.insert(0, Block())
import pkgutil, splitserve.router as r
for m in pkgutil.walk_packages(r.__path__, "splitserve.router."):
    __import__(m.name)
assert "torch" not in sys.modules
print("ok")
"""


def test_router_imports_without_torch():
    out = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
