"""The autoscaler's arithmetic and its hysteresis, with the real simulator (no cluster)."""

from __future__ import annotations

from splitserve.cluster.autoscale import Mix, Planner, mix_between
from splitserve.workload.metrics import SLO


def _counters(requests, prompt, cached, generated):
    return {"requests": requests, "prompt": prompt, "cached": cached, "generated": generated}


def test_mix_counts_requests_on_decode_workers_and_tokens_computed_everywhere():
    before = {"p": _counters(5, 5000, 0, 5), "d": _counters(5, 5000, 4800, 50)}
    after = {"p": _counters(9, 9000, 0, 9), "d": _counters(9, 9000, 8400, 90)}
    mix = mix_between(before, after, 20.0, decode={"d"})
    # 4 requests; prefill computed 4000 new tokens, the decode worker 4000 - 3600 = 400
    assert mix == Mix(20.0, 4, 1100.0, 10.0) and mix.rate == 0.2


def test_mix_counts_a_new_or_restarted_worker_from_zero():
    before = {"a": _counters(10, 1000, 0, 100)}
    after = {"a": _counters(2, 200, 0, 20), "b": _counters(1, 100, 50, 10)}
    assert mix_between(before, after, 10.0, decode={"a", "b"}) == Mix(10.0, 3, 250 / 3, 10.0)
    assert mix_between(after, after, 10.0, decode={"a", "b"}).requests == 0


def test_a_better_split_must_win_twice_in_a_row_and_too_few_requests_decide_nothing():
    planner = Planner(SLO.parse("ttft:3000,tpot:250"), host_cores=2, remote_prefill_threshold=64)
    long_prompts = Mix(60.0, 18, 600.0, 12.0)  # 0.3 req/s of 600-token prompts
    scores = planner.scores(long_prompts, 2)
    best = max(scores, key=lambda s: scores[s])
    assert best != (1, 1) and scores[best][0] >= scores[(1, 1)][0] + planner.margin
    first = planner.decide(long_prompts, (1, 1))
    assert (first.action, first.best) == ("wait", best)
    few = planner.decide(Mix(60.0, 2, 600.0, 12.0), (1, 1))  # resets the streak
    assert few.action == "keep" and "too few" in few.reason
    assert planner.decide(long_prompts, (1, 1)).action == "wait"
    second = planner.decide(long_prompts, (1, 1))
    assert (second.action, second.best) == ("scale", best)
    assert planner.decide(long_prompts, best).action == "keep"  # already there


def test_a_tie_keeps_the_current_split():
    planner = Planner(SLO.parse("ttft:3000,tpot:250"), host_cores=2, remote_prefill_threshold=64)
    short = Mix(60.0, 30, 40.0, 12.0)  # 0.5 req/s of short prompts: every split meets the SLO
    scores = planner.scores(short, 2)
    assert len({round(v[0], 6) for v in scores.values()}) == 1
    for current in scores:
        decision = planner.decide(short, current)
        assert (decision.action, decision.best) == ("keep", current)
