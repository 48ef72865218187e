"""The options of ``benchmarks/router_overhead.py`` that decide what it measures."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "router_overhead.py"
_spec = importlib.util.spec_from_file_location("router_overhead", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_pinned_placement_gives_the_router_the_last_cpu():
    assert bench.split_cpus("pinned", {0, 1}) == ({1}, {0})
    assert bench.split_cpus("pinned", {2, 5, 7}) == ({7}, {2, 5})
    assert bench.split_cpus("shared", {0, 1}) == (None, None)


def test_pinned_placement_needs_two_cpus():
    with pytest.raises(SystemExit, match="at least 2 CPUs"):
        bench.split_cpus("pinned", {0})


def test_defaults_pace_the_echo_worker_like_a_model():
    args = bench.parse_args([])
    assert (args.placement, args.token_interval_ms, args.clients) == ("pinned", 20.0, 64)
    args = bench.parse_args(["--placement", "shared", "--token-interval-ms", "0"])
    assert (args.placement, args.token_interval_ms) == ("shared", 0.0)


@pytest.mark.parametrize(
    "argv",
    [["--token-interval-ms", "-1"], ["--clients", "0"], ["--placement", "spread"]],
)
def test_bad_options_are_rejected(argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
