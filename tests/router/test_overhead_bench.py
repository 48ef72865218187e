"""The options of ``benchmarks/router_overhead.py`` that decide what it measures."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "router_overhead.py"
_spec = importlib.util.spec_from_file_location("router_overhead", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
load = sys.modules["router_load"]  # the load generator's module, imported by the benchmark


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
    [
        ["--token-interval-ms", "-1"],
        ["--clients", "0"],
        ["--placement", "spread"],
        ["--arrivals", "bursty"],
        ["--tls", "--worker-url", "http://127.0.0.1:1"],  # TLS measures the echo worker only
    ],
)
def test_bad_options_are_rejected(argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


BODY = {"messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 32}


def lengths(plan) -> list[int]:
    return [json.loads(b)["max_tokens"] for bodies in plan.bodies for b in bodies]


def test_lockstep_clients_start_together_with_equal_lengths():
    plan = load.make_plan("lockstep", 4, 3, BODY, 0.8, seed=0)
    assert plan.starts == [0.0] * 4 and plan.arrivals is None
    assert lengths(plan) == [32] * 12


def test_staggered_clients_spread_over_one_request_and_vary_lengths():
    plan = load.make_plan("staggered", 4, 50, BODY, 0.8, seed=0)
    assert plan.starts == pytest.approx([0.0, 0.2, 0.4, 0.6])
    assert min(lengths(plan)) >= 16 and max(lengths(plan)) <= 48
    assert len(set(lengths(plan))) > 10
    assert load.make_plan("staggered", 4, 50, BODY, 0.8, seed=0) == plan  # both paths alike


def test_poisson_arrivals_keep_the_mean_concurrency():
    plan = load.make_plan("poisson", 64, 100, BODY, 0.5, seed=1)
    assert plan.starts is None and len(plan.arrivals) == 6400
    rate = len(plan.arrivals) / plan.arrivals[-1]
    assert rate * 0.5 == pytest.approx(64, rel=0.05)  # Little's law: rate x duration


def test_bursts_count_the_requests_sent_just_before():
    timings = [load.Timing(s, 0.0, 0.0) for s in (0.0, 0.001, 0.002, 1.0, 2.0)]
    assert load.bursts(timings, window_s=0.005) == [1, 2, 3, 1, 1]


def test_bucket_quantile_interpolates_like_prometheus():
    buckets = {0.001: 50.0, 0.002: 90.0, 0.005: 100.0, math.inf: 100.0}
    assert load.bucket_quantile(0.5, buckets) == pytest.approx(0.001)
    assert load.bucket_quantile(0.7, buckets) == pytest.approx(0.0015)
    assert load.bucket_quantile(0.99, buckets) == pytest.approx(0.0047)
    assert math.isnan(load.bucket_quantile(0.5, {math.inf: 0.0}))


# ---- --peer vllm-router ----------------------------------------------------------------------

peer = sys.modules["router_peer"]


def _vllm_router() -> str | None:
    try:
        return peer.find_vllm_router()
    except ValueError:
        return None


def test_peer_defaults_to_round_robin_and_checks_the_policy():
    assert peer.parse_peer("vllm-router") == peer.Peer("round_robin")
    assert peer.parse_peer("vllm-router:consistent_hash").name == "vllm-router:consistent_hash"
    for spec in ("vllm-router:fastest", "sglang-router"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--peer", spec])


def test_peer_without_vllm_router_exits_with_one_line(tmp_path):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--peer", "vllm-router", "--vllm-router-bin", str(tmp_path / "none")])
    message = str(exc.value.code)
    assert "vllm-router is not installed" in message and "\n" not in message


def test_cpu_description_names_the_model_and_isa_flags(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    info = "processor\t: {}\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f hypervisor\n\n"
    cpuinfo.write_text(info.format(0) + info.format(1))
    described = peer.cpu_description(cpuinfo)
    assert described == "AMD EPYC, 2 logical CPUs; flags: avx2 avx512f hypervisor"


@pytest.mark.skipif(_vllm_router() is None, reason="vllm-router is not installed")
def test_peer_is_measured_in_the_same_rounds(capsys):
    argv = ["--clients", "2", "--requests", "2", "--rounds", "1", "--max-tokens", "2"]
    argv += ["--token-interval-ms", "0", "--placement", "shared", "--peer", "vllm-router"]
    bench.overhead(bench.parse_args(argv))
    out = capsys.readouterr().out
    name = "vllm-router:round_robin"
    table = out[out.index("added over direct") :].splitlines()
    assert [row.split()[0] for row in table[1:3]] == ["router", name]
    assert all(len(row.split()) == 7 for row in table[1:3])  # name and six figures
    assert f"{name}: added latency p50" in out and "router: added latency p50" in out
    assert f"p99 added latency, router / {name} (end to end):" in out
    assert f"p99 added latency, router / {name} (first chunk):" in out
    assert f"p99 added end to end, router - {name}, round by round: median" in out
