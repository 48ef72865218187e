"""Goodput, attainment and percentile arithmetic on hand-made latency sets."""

from __future__ import annotations

import json
import math

import pytest

from splitserve.workload.metrics import (
    SLO,
    RequestRecord,
    format_summary,
    percentile,
    session_records,
    summarize,
)


def _rec(sid, turn, start, ttft, e2e, out=11, ok=True, prompt=100):
    itl = [(e2e - ttft) / (out - 1)] * (out - 1) if ok and out > 1 else []
    return RequestRecord(
        sid, turn, start, ok, prompt, out if ok else 0, 0, ttft, itl, e2e, "" if ok else "HTTP 503"
    )


def test_percentiles_interpolate_like_numpy_and_vllm():
    values = list(range(1, 101))
    assert percentile(values, 50) == 50.5
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0
    assert math.isnan(percentile([], 50))


def test_tpot_excludes_the_first_token():
    r = _rec("s", 0, 0.0, ttft=0.2, e2e=1.2, out=11)
    assert r.tpot_s == pytest.approx(0.1)
    assert _rec("s", 0, 0.0, 0.2, 0.2, out=1).tpot_s is None
    assert _rec("s", 0, 0.0, 0.2, 1.2, ok=False).tpot_s is None


def test_slo_parse():
    slo = SLO.parse("ttft:500,tpot:50", "jct:8000")
    assert slo == SLO(ttft_ms=500, tpot_ms=50, jct_ms=8000)
    assert SLO.parse("e2el:900").e2e_ms == 900
    assert slo.describe() == "ttft<=500ms tpot<=50ms jct<=8000ms"
    assert SLO().describe() == "none"
    for bad in ("ttft", "ttft:fast", "latency:5"):
        with pytest.raises(ValueError):
            SLO.parse(bad)


def test_slo_met_needs_every_objective_and_success():
    slo = SLO(ttft_ms=500, tpot_ms=100)
    assert slo.met(_rec("s", 0, 0, ttft=0.5, e2e=1.5))  # tpot exactly 100 ms: met
    assert not slo.met(_rec("s", 0, 0, ttft=0.501, e2e=1.5))
    assert not slo.met(_rec("s", 0, 0, ttft=0.1, e2e=2.0))  # tpot 190 ms
    assert not slo.met(_rec("s", 0, 0, ttft=0.1, e2e=0.2, ok=False))
    assert SLO().met(_rec("s", 0, 0, ttft=9, e2e=99))


def _hand_made():
    # Two sessions over 10 s. a: both turns fast. b: turn 0 fast, turn 1 slow TTFT.
    # c: one request that failed.
    return [
        _rec("a", 0, 0.0, ttft=0.1, e2e=1.0),
        _rec("a", 1, 3.0, ttft=0.2, e2e=1.0),
        _rec("b", 0, 1.0, ttft=0.3, e2e=1.3),
        _rec("b", 1, 5.0, ttft=0.9, e2e=2.0),
        _rec("c", 0, 2.0, ttft=None, e2e=0.05, ok=False),
    ]


def test_goodput_and_attainment():
    s = summarize(_hand_made(), duration_s=10.0, slo=SLO(ttft_ms=500))
    assert (s.completed, s.failed) == (4, 1)
    assert s.request_throughput == pytest.approx(0.4)
    assert s.request_goodput == pytest.approx(0.3)  # a0, a1, b0
    assert s.slo_attainment == pytest.approx(3 / 5)
    assert (s.sessions, s.sessions_ok) == (3, 2)
    assert s.session_goodput == pytest.approx(0.1)  # only a
    assert s.session_attainment == pytest.approx(1 / 3)
    assert s.total_input_tokens == 400 and s.total_output_tokens == 44
    assert s.output_throughput == pytest.approx(4.4)
    assert s.ttft.mean == pytest.approx(375.0) and s.ttft.median == pytest.approx(250.0)
    assert s.e2e.percentiles[99] == pytest.approx(1000 * percentile([1.0, 1.0, 1.3, 2.0], 99))
    assert s.errors == {"HTTP 503": 1}


def test_session_slo_on_job_completion_time():
    sessions = {r.session_id: r for r in session_records(_hand_made(), SLO(jct_ms=5000))}
    assert sessions["a"].jct_s == pytest.approx(4.0) and sessions["a"].met
    assert sessions["b"].jct_s == pytest.approx(6.0) and not sessions["b"].met
    assert not sessions["c"].ok and not sessions["c"].met


def test_summary_prints_the_vllm_layout_and_serializes():
    s = summarize(
        _hand_made(), 10.0, SLO(ttft_ms=500), {"prefix_cache_hit_rate": 0.5}, {"workload": "test"}
    )
    text = format_summary(s)
    for label in (
        "Successful requests:",
        "Benchmark duration (s):",
        "Request goodput (req/s):",
        "Mean TTFT (ms):",
        "P99 TPOT (ms):",
        "Median ITL (ms):",
        "Mean E2EL (ms):",
        "Session goodput (sessions/s):",
        "prefix_cache_hit_rate:",
        "workload: test",
    ):
        assert label in text
    assert "Successful requests:                     4" in text
    back = json.loads(json.dumps(s.to_dict()))
    assert back["request_goodput"] == pytest.approx(0.3) and back["ttft"]["percentiles"]["99"]


def test_empty_run_summarizes_without_crashing():
    s = summarize([], 0.0)
    assert s.completed == 0 and math.isnan(s.request_throughput)
    assert "Successful requests:" in format_summary(s)


def test_server_figures_are_the_runs_share_of_the_counters():
    from splitserve.bench.scrape import server_figures

    before = {"prompt_tokens": 100.0, "cached_prompt_tokens": 40.0, "session_turns": 10.0}
    before |= {"turns_moved": 3.0}
    after = {"prompt_tokens": 1100.0, "cached_prompt_tokens": 790.0, "session_turns": 50.0}
    after |= {"turns_moved": 13.0}
    figures = server_figures(before, after)
    assert figures["prefix_cache_hit_rate"] == 0.75  # 750 of 1000 prompt tokens cached
    assert figures["prefill_tokens_computed"] == 250.0
    assert figures["turns_moved_fraction"] == 0.25  # 10 of 40 turns left the previous worker
    assert server_figures(before, before)["turns_moved_fraction"] == 0.0


def test_serving_cpu_is_everything_but_the_engine_threads_steps():
    from splitserve.bench.scrape import serving_cpu_seconds

    figures = {"worker_cpu_seconds": 50.0, "engine_cpu_seconds": 45.0}
    figures |= {"router_cpu_seconds": 2.0, "client_cpu_seconds": 1.5}
    assert serving_cpu_seconds(figures) == 8.5  # 5 in the workers, 2 router, 1.5 client
