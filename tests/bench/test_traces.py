"""Trace replay keeps the trace's sharing exactly: k common hash ids, k common blocks."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from splitserve.workload.sessions import poisson_arrivals
from splitserve.workload.traces import (
    TraceReplay,
    TraceScale,
    load_trace,
    parse_azure,
    parse_mooncake,
    resolve_trace,
    synthesize_prompt,
    traces_dir,
)


def _line(ts, n_in, n_out, ids):
    return json.dumps(
        {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}
    )


def _common_prefix(a, b):
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


@pytest.mark.parametrize("block", [2, 16, 32])
@pytest.mark.parametrize("k", [0, 1, 3])
def test_k_common_hash_ids_share_exactly_k_blocks(block, k):
    a_ids = [0, 1, 2][:k] + [100, 101]
    b_ids = [0, 1, 2][:k] + [200, 201]
    a, b = parse_mooncake([_line(0, 512 * 5, 10, a_ids), _line(0, 512 * 5, 10, b_ids)])
    scale = TraceScale(block_tokens=block)
    pa, pb = synthesize_prompt(a, scale, seed=0), synthesize_prompt(b, scale, seed=0)
    assert _common_prefix(pa, pb) == k * block


def test_hash_ids_equal_modulo_the_id_range_share_one_token_more():
    # Block heads encode the id in two tokens: ids 5 and 5 + 48000 share the first one,
    # which never completes another cache block.
    a, b = parse_mooncake([_line(0, 1024, 1, [5, 5]), _line(0, 1024, 1, [5, 48005])])
    pa, pb = (synthesize_prompt(r, TraceScale(16), 0) for r in (a, b))
    assert _common_prefix(pa, pb) == 16 + 1


def test_scaled_lengths():
    (req,) = parse_mooncake([_line(0, 512 * 2 + 256, 320, [1, 2, 3])])
    scale = TraceScale(block_tokens=16, output_floor=4)
    assert len(synthesize_prompt(req, scale, 0)) == 16 + 16 + 8
    assert scale.output_len(320) == 10 and scale.output_len(3) == 4
    (tiny,) = parse_mooncake([_line(0, 512 + 1, 1, [1, 2])])
    assert len(synthesize_prompt(tiny, scale, 0)) == 16 + 2  # the last block keeps two tokens


def test_replay_compresses_time_and_skips_long_requests():
    lines = [
        _line(1000 * i, 512 * (1 + 10 * (i == 2)), 64, list(range(i, i + 1 + 10 * (i == 2))))
        for i in range(5)
    ]
    trace = TraceReplay(
        tuple(parse_mooncake(lines)), "inline", TraceScale(16, max_input_tokens=100)
    )
    assert trace.native_rate == pytest.approx(1.0)
    assert trace.skipped() == 1
    sessions = list(trace.sessions(4.0))
    assert [s.session_id for s in sessions] == ["r0", "r1", "r3", "r4"]
    assert [s.arrival_s for s in sessions] == pytest.approx([0, 0.25, 0.75, 1.0])
    assert [s.arrival_s for s in trace.sessions(None)] == pytest.approx([0, 1, 3, 4])
    assert all(s.api == "completions" and not s.sticky for s in sessions)
    assert list(trace.sessions(4.0)) == sessions  # deterministic
    poisson = list(dataclasses.replace(trace, timing="poisson").sessions(4.0))
    assert [s.turns for s in poisson] == [s.turns for s in sessions]
    assert [s.arrival_s for s in poisson] == list(itertools.islice(poisson_arrivals(4.0, 0), 4))


def test_azure_csv():
    rows = [
        "TIMESTAMP,ContextTokens,GeneratedTokens",
        "2023-11-16 18:15:46.6805900,374,44",
        "2023-11-16 18:15:50.9951690,396,109",
    ]
    reqs = parse_azure(rows)
    assert [r.timestamp_s for r in reqs] == pytest.approx([0.0, 4.314579])
    assert [(r.input_length, r.output_length) for r in reqs] == [(374, 44), (396, 109)]
    trace = TraceReplay(tuple(reqs), "inline", TraceScale(32), name="azure")
    s0, s1 = trace.sessions(None)
    assert s0.input_len(0) == round(374 / 16) and s1.turns[0].output_len == round(109 / 16)
    assert _common_prefix(s0.prompt_token_ids(0), s1.prompt_token_ids(0)) < 3


@pytest.mark.parametrize(
    "lines, parse",
    [
        (['{"timestamp": 0}'], parse_mooncake),
        (["not json"], parse_mooncake),
        (["TIMESTAMP,Context", "1,2"], parse_azure),
        (["TIMESTAMP,ContextTokens,GeneratedTokens", "yesterday,1,2"], parse_azure),
    ],
)
def test_bad_traces_are_clear_errors(lines, parse):
    with pytest.raises(ValueError):
        parse(lines)


def test_missing_trace_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_TRACES_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="not found"):
        resolve_trace("conversation")
    (tmp_path / "mooncake_conversation_trace.jsonl").write_text(_line(0, 100, 5, [0]) + "\n")
    assert load_trace("mooncake", "conversation").requests[0].input_length == 100


def test_the_shipped_conversation_trace_replays(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_TRACES_DIR", raising=False)
    assert traces_dir().parts[-3:] == ("workload", "data", "traces")
    trace = load_trace("mooncake", "conversation")
    first = list(itertools.islice(trace.sessions(2.0), 200))
    assert len(first) == 200 and first[-1].arrival_s > 0
    assert all(s.input_len(0) <= trace.scale.max_input_tokens for s in first)
