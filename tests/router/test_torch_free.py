"""The router deploys without torch: importing all of it must never import torch."""

from __future__ import annotations

from torchless import run_without_torch

IMPORT_ALL = """
import pkgutil, splitserve.router as r
for m in pkgutil.walk_packages(r.__path__, "splitserve.router."):
    __import__(m.name)
"""


def test_router_imports_without_torch():
    run_without_torch(IMPORT_ALL, timeout=60)
