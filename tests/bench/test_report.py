"""Comparison tables (ratios to the first deployment), strict JSON and the two plots."""

from __future__ import annotations

import json

from splitserve.workload.metrics import SLO, RequestRecord, summarize
from splitserve.workload.report import (
    FIGURES,
    MEAN_HEADERS,
    markdown_table,
    mean_rows,
    plot,
    rows,
    run_dict,
    text_table,
    write_json,
)
from splitserve.workload.runs import RunResult


def _run(ttft: float, n: int, duration: float = 10.0) -> RunResult:
    recs = [
        RequestRecord(f"s{i}", 0, float(i), True, 100, 5, 0, ttft, [0.01] * 4, ttft + 0.04)
        for i in range(n)
    ]
    return RunResult(summarize(recs, duration, SLO(ttft_ms=500)), recs)


def test_ratios_are_to_the_first_deployment_at_the_same_load():
    runs = [
        ("base", "rate 1/s", _run(0.1, 10).summary),
        ("base", "rate 2/s", _run(0.1, 20).summary),
        ("fast", "rate 1/s", _run(0.1, 30).summary),
        ("slow", "rate 2/s", _run(0.9, 20).summary),  # misses the TTFT SLO: goodput 0
    ]
    table = rows(runs, ratios=True)
    assert table[0][2] == "1 (1.00x)" and table[2][2] == "3 (3.00x)"
    assert table[3][2] == "0 (0.00x)" and table[3][6] == "900 (9.00x)"  # TTFT p50
    assert text_table(table).splitlines()[0].startswith("deployment  load")
    md = markdown_table(table).splitlines()
    assert md[1].count("---") == len(table[0]) and md[4].startswith("| fast | rate 1/s | 3 (3.00x)")


def test_means_over_repeats_and_the_ratio_of_means():
    # Goodput is requests within the SLO per second of a 10 s run: 10, 30 -> 1, 3 req/s.
    groups = [
        ("base", "rate 1/s", [_run(0.1, 10).summary, _run(0.1, 30).summary]),
        ("tiered", "rate 1/s", [_run(0.1, 50).summary, _run(0.1, 70).summary]),
        ("late", "rate 1/s", [_run(0.9, 50).summary, _run(0.1, 50).summary]),
    ]
    table = mean_rows(groups)
    assert table[0][:7] == ["base", "rate 1/s", "2", "2", "1", "3", "1.00x"]
    assert table[1][:7] == ["tiered", "rate 1/s", "2", "6", "5", "7", "3.00x"]
    # One run of two misses the TTFT objective: mean 2.5 of 0 and 5, attainment 50%.
    assert table[2][3:7] == ["2.5", "0", "5", "1.25x"]
    assert table[2][MEAN_HEADERS.index("SLO att. % mean")] == "50"
    assert table[2][MEAN_HEADERS.index("TTFT p50 ms mean")] == "500"
    assert len(table[0]) == len(MEAN_HEADERS)


def test_json_is_strict_and_plots_are_written(tmp_path):
    run = _run(0.2, 3)
    empty = RunResult(summarize([], 1.0), [])
    write_json(tmp_path / "r.json", [run_dict(run, rate=1.0), run_dict(empty, rate=2.0)])
    text = (tmp_path / "r.json").read_text()
    assert "NaN" not in text and json.loads(text)[1]["summary"]["ttft"]["mean"] is None
    paths = plot(tmp_path / "p.png", {"a": [(1.0, run), (2.0, _run(0.3, 6))], "b": [(1.0, run)]})
    assert [p.name for p in paths] == ["p.png", "p_ttft_cdf.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)


def test_cache_hits_come_from_the_workers_counters_or_else_the_responses():
    recs = [RequestRecord("s", 0, 0.0, True, 100, 5, 40, 0.1, [0.01] * 4, 0.14)]
    client_only = summarize(recs, 10.0, SLO(ttft_ms=500))  # vLLM workers: no such counter
    counted = summarize(
        recs, 10.0, SLO(ttft_ms=500), {"prompt_tokens": 100.0, "prefix_cache_hit_rate": 0.5}
    )
    column = 2 + [h for h, _, _ in FIGURES].index("cache hit %")
    assert rows([("vllm", "r", client_only)])[0][column] == "40"
    assert rows([("builtin", "r", counted)])[0][column] == "50"
