"""The simulator runs with ``pip install 'splitserve[sim]'``: a whole simulated run never
imports torch, numba, matplotlib or any other package outside that extra."""

from __future__ import annotations

from torchless import ENGINE_MODULES, run_with_extras

RUN = """
import pkgutil, splitserve.sim as s
for m in pkgutil.walk_packages(s.__path__, "splitserve.sim."):
    __import__(m.name)
from splitserve.cli import main
assert main(["sim", "--rate", "2", "--duration", "3", "--prefill", "1", "--decode", "1"]) == 0
assert main(["sim", "--rate", "2", "--duration", "3", "--host-kv-gb", "1"]) == 0
"""


def test_a_simulated_run_needs_only_the_sim_extra():
    blocked = run_with_extras(["sim"], RUN, timeout=120)
    assert set(ENGINE_MODULES) <= blocked
