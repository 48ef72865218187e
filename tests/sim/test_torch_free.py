"""The simulator runs without torch: a whole simulated run must never import it."""

from __future__ import annotations

from torchless import run_without_torch

RUN = """
import pkgutil, splitserve.sim as s
for m in pkgutil.walk_packages(s.__path__, "splitserve.sim."):
    __import__(m.name)
from splitserve.cli import main
assert main(["sim", "--rate", "2", "--duration", "3", "--prefill", "1", "--decode", "1"]) == 0
assert main(["sim", "--rate", "2", "--duration", "3", "--host-kv-gb", "1"]) == 0
"""


def test_a_simulated_run_never_imports_torch():
    run_without_torch(RUN, timeout=120)
