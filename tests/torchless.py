"""Run code in a fresh interpreter in which importing torch fails, for the parts of the
project that must deploy without it (router, simulator)."""

from __future__ import annotations

import subprocess
import sys

_BLOCK_TORCH = """
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
        return None

sys.meta_path.insert(0, Block())
"""

_CHECK = """
assert "torch" not in sys.modules
print("ok")
"""


def run_without_torch(code: str, timeout: float) -> None:
    """Run ``code`` with torch blocked; fail if it errs or torch got imported anyway."""
    out = subprocess.run(
        [sys.executable, "-c", _BLOCK_TORCH + code + _CHECK],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")
