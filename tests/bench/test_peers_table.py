"""How ``benchmarks/engine_vs_vllm.py`` orders its repeats and reports them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(_DIR))  # the script imports its neighbour router_peer
_spec = importlib.util.spec_from_file_location("engine_vs_vllm", _DIR / "engine_vs_vllm.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["engine_vs_vllm"] = bench  # its dataclasses look their module up
_spec.loader.exec_module(bench)

OURS, PEER = bench.OURS, "vllm-single-all"


def test_repeats_alternate_their_order_so_drift_weighs_on_both_sides():
    assert bench.schedule([OURS, PEER], 1) == [(0, OURS), (0, PEER)]
    assert bench.schedule([OURS, PEER], 3) == [
        *((0, OURS), (0, PEER)),
        *((1, PEER), (1, OURS)),
        *((2, OURS), (2, PEER)),
    ]


def test_one_run_gives_plain_figures_and_ratios():
    w = bench.WORKLOADS[0]
    text = bench.table({(OURS, 0): [50.0], (PEER, 0): [20.0]}, [OURS, PEER], [(0, w)])
    assert text.splitlines()[2] == f"| {w.name} | {w.unit} | 50 | 20 | 2.50x |"


def test_repeats_give_the_mean_and_range_and_pair_each_repeats_runs():
    w = bench.WORKLOADS[2]
    results = {(OURS, 2): [400.0, 300.0, 350.0], (PEER, 2): [200.0, 300.0, None]}
    row = bench.table(results, [OURS, PEER], [(2, w)]).splitlines()[2]
    # ratios 2.0 and 1.0 (the third repeat's peer failed: no ratio for it)
    assert row == f"| {w.name} | {w.unit} | 350 (300-400) | 250 (200-300) | 1.50x (1.00-2.00x) |"


def test_a_deployment_without_figures_is_a_dash():
    w = bench.WORKLOADS[0]
    row = bench.table({(OURS, 0): [None]}, [OURS, PEER], [(0, w)]).splitlines()[2]
    assert row == f"| {w.name} | {w.unit} | - | - | - |"
