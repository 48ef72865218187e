"""Workloads are seeded: the same seed gives the same sessions, prompts, pauses and arrivals."""

from __future__ import annotations

import hashlib
import itertools

import pytest

from splitserve.workload.sessions import (
    AgenticConfig,
    LogNormal,
    MultiRoundQAConfig,
    RandomConfig,
    poisson_arrivals,
    within,
)
from splitserve.workload.vocab import WORDS, text_of


def _take(workload, rate, n=20):
    return list(itertools.islice(workload.sessions(rate), n))


@pytest.mark.parametrize("make", [AgenticConfig, MultiRoundQAConfig, RandomConfig])
def test_same_seed_same_sessions(make):
    assert _take(make(seed=7), 2.0) == _take(make(seed=7), 2.0)
    assert _take(make(seed=7), 2.0) != _take(make(seed=8), 2.0)


@pytest.mark.parametrize(
    ("make", "digest"),
    [
        (AgenticConfig, "5ee08829f0d47f00"),
        (MultiRoundQAConfig, "90904effefcb3cfc"),
        (RandomConfig, "962f75a5345df762"),
    ],
)
def test_seeded_draws_are_pinned(make, digest):
    # Stored real runs are re-simulated from their seed (benchmarks/sim_validate.py): a
    # change to the draws must be deliberate, with this digest and those runs' docs updated.
    h = hashlib.sha256()
    for s in _take(make(seed=7), 2.0):
        turns = [(t.pause_s, t.output_ids) for t in s.turns]
        h.update(repr((s.arrival_s, turns, s.prompt_token_ids(len(s.turns) - 1))).encode())
    assert h.hexdigest()[:16] == digest


def test_drawn_ids_are_one_int_object_per_value():
    # A simulated cluster keeps every cached block's tokens: one object per value, not per draw.
    seen: dict[int, int] = {}
    for s in _take(AgenticConfig(seed=3), 2.0) + _take(RandomConfig(seed=3), 2.0):
        for t in s.turns:
            for tid in itertools.chain(t.output_ids, *(seg.token_ids for seg in t.segments)):
                assert seen.setdefault(tid, id(tid)) == id(tid)
    assert len(seen) > 1000


def test_rate_changes_only_the_arrival_times():
    slow, fast = _take(AgenticConfig(seed=3), 0.5), _take(AgenticConfig(seed=3), 2.0)
    for a, b in zip(slow, fast, strict=True):
        assert a.turns == b.turns and a.session_id == b.session_id
        assert a.arrival_s == pytest.approx(4 * b.arrival_s)


def test_poisson_arrivals_have_the_asked_mean_rate():
    times = list(itertools.islice(poisson_arrivals(5.0, seed=1), 20001))
    assert times[0] == 0.0 and times == sorted(times)
    assert 20000 / times[-1] == pytest.approx(5.0, rel=0.03)
    assert set(itertools.islice(poisson_arrivals(None, seed=1), 5)) == {0.0}


def test_within_stops_at_the_duration():
    sessions = list(within(AgenticConfig().sessions(1.0), 30.0))
    assert sessions and all(s.arrival_s < 30.0 for s in sessions)


def test_agentic_session_shape():
    cfg = AgenticConfig(agent_types=3, system_tokens=40, task_tokens=8, seed=5)
    sessions = _take(cfg, 1.0, 50)
    systems = {s.agent_type: s.turns[0].segments[0].token_ids for s in sessions}
    assert len(systems) == 3 and len(set(systems.values())) == 3  # one per agent type
    for s in sessions:
        assert s.turns[0].segments[0].token_ids == systems[s.agent_type]
        assert s.turns[0].pause_s == 0.0 and all(t.pause_s > 0 for t in s.turns[1:])
        assert cfg.min_tool_calls + 1 <= len(s.turns) <= cfg.max_tool_calls + 1
        assert [t.output_len for t in s.turns[:-1]] == [cfg.tool_call_tokens] * (len(s.turns) - 1)
        assert s.turns[-1].output_len == cfg.answer_tokens
        assert [seg.role for t in s.turns[1:] for seg in t.segments] == ["tool"] * (
            len(s.turns) - 1
        )


def test_prompt_is_the_whole_conversation_resent():
    s = _take(AgenticConfig(seed=2), 1.0, 1)[0]
    for k in range(1, len(s.turns)):
        prev, cur = s.prompt_token_ids(k - 1), s.prompt_token_ids(k)
        new = [t for seg in s.turns[k].segments for t in seg.token_ids]
        assert cur == prev + list(s.turns[k - 1].output_ids) + new
        assert s.input_len(k) == len(cur)
    real = [[1, 2, 3]] * len(s.turns)
    assert s.prompt_token_ids(1, real)[len(s.prompt_token_ids(0)) :][:3] == [1, 2, 3]


def test_messages_match_the_token_view():
    s = _take(AgenticConfig(seed=4), 1.0, 1)[0]
    k = len(s.turns) - 1
    msgs = s.messages(k)
    assert [m["role"] for m in msgs[:3]] == ["system", "user", "assistant"]
    assert " ".join(m["content"] for m in msgs) == text_of(s.prompt_token_ids(k))
    assert s.messages(1, ["the real reply"])[2] == {
        "role": "assistant",
        "content": "the real reply",
    }
    assert all(w in WORDS for w in msgs[0]["content"].split())


def test_multi_round_qa_shares_one_system_prompt():
    sessions = _take(MultiRoundQAConfig(rounds=3, system_tokens=16), 1.0, 5)
    assert len({s.turns[0].segments[0].token_ids for s in sessions}) == 1
    assert all(len(s.turns) == 3 and s.turns[1].pause_s == 2.0 for s in sessions)


def test_random_is_token_level_and_exact_length():
    s = _take(RandomConfig(input_len=100, output_len=7), 1.0, 1)[0]
    assert s.api == "completions" and not s.sticky
    assert s.input_len(0) == 100 and s.turns[0].output_len == 7


@pytest.mark.parametrize(
    "bad",
    [
        lambda: AgenticConfig(min_tool_calls=3, max_tool_calls=2),
        lambda: AgenticConfig(agent_types=0),
        lambda: RandomConfig(input_len=0),
        lambda: LogNormal(-1.0),
        lambda: LogNormal.parse("1,2,3"),
        lambda: LogNormal.parse("fast"),
    ],
)
def test_bad_configs_are_refused(bad):
    with pytest.raises(ValueError):
        bad()


def test_lognormal():
    assert LogNormal.parse("1.5") == LogNormal(1.5, 0.0)
    assert LogNormal.parse("2,0.5") == LogNormal(2.0, 0.5)
