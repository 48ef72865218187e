from __future__ import annotations

import pytest

from splitserve.common.kv_hash import root_hash
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.plan import StepPlan, StepResult
from splitserve.engine.scheduler import Scheduler, SchedulerConfig
from splitserve.engine.sequence import Sequence, SequenceStatus

BS = 4
EOS = 0


def make(num_blocks=16, max_seqs=8, budget=8, max_len=64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_seqs, budget, max_len), BlockManager(num_blocks, BS))


def seq(rid: str, n: int, first: int = 1, **params) -> Sequence:
    params.setdefault("max_tokens", 4)
    tokens = list(range(first, first + n))
    return Sequence(rid, tokens, SamplingParams(**params), root_hash("m"), eos_token_ids=(EOS,))


def step(sched: Scheduler, token: int = 7) -> StepPlan:
    """One engine step with a stand-in model that always samples ``token``."""
    plan = sched.schedule()
    sampled = {c.request_id: token for c in plan.chunks if c.sample}
    sched.update(plan, StepResult(sampled))
    return plan


def shape(plan: StepPlan) -> list[tuple[str, int, int, bool]]:
    return [(c.request_id, c.start_pos, c.num_tokens, c.sample) for c in plan.chunks]


def test_chunked_prefill_respects_token_budget():
    s = make(budget=8)
    s.add(seq("a", 20))
    assert shape(step(s)) == [("a", 0, 8, False)]
    assert shape(step(s)) == [("a", 8, 8, False)]
    assert shape(step(s)) == [("a", 16, 4, True)]
    assert shape(step(s)) == [("a", 20, 1, True)]  # decode


def test_decodes_first_then_new_prefill_with_the_rest():
    s = make(budget=8)
    s.add(seq("a", 3))
    step(s)
    s.add(seq("b", 12, first=50))
    assert shape(step(s)) == [("a", 3, 1, True), ("b", 0, 7, False)]
    assert shape(step(s)) == [("a", 4, 1, True), ("b", 7, 5, True)]


def test_max_num_seqs_limits_running_batch():
    s = make(max_seqs=2, budget=64)
    for i in range(3):
        s.add(seq(f"r{i}", 2, first=10 * i + 1))
    plan = step(s)
    assert [c.request_id for c in plan.chunks] == ["r0", "r1"]
    assert [q.request_id for q in s.waiting] == ["r2"]


def test_finishes_on_max_tokens_and_frees_blocks():
    s = make()
    a = seq("a", 3, max_tokens=2)
    s.add(a)
    step(s)
    step(s)
    assert a.finish_reason == "length" and a.output_token_ids == [7, 7]
    assert a.is_finished and not s.has_unfinished()
    assert s.block_manager.num_free_blocks == 16


def test_finishes_on_eos_unless_ignore_eos():
    s = make()
    a, b = seq("a", 3, max_tokens=5), seq("b", 3, first=20, max_tokens=5, ignore_eos=True)
    s.add(a)
    s.add(b)
    step(s, token=EOS)
    assert a.finish_reason == "stop" and a.output_token_ids == [EOS]
    assert not b.is_finished


def test_stop_token_ids():
    s = make()
    a = seq("a", 3, stop_token_ids=[9])
    s.add(a)
    step(s, token=9)
    assert a.finish_reason == "stop"


def test_max_model_len_ends_generation():
    s = make(max_len=6)
    a = seq("a", 4, max_tokens=10)
    s.add(a)
    step(s)
    step(s)
    assert a.finish_reason == "length" and a.num_tokens == 6


def test_prompt_longer_than_max_model_len_is_rejected():
    s = make(max_len=8)
    with pytest.raises(ValueError, match="maximum model length is 8"):
        s.add(seq("a", 8))


def test_preempts_newest_when_blocks_run_out():
    s = make(num_blocks=4, budget=64)
    a, b = seq("a", 7, max_tokens=10), seq("b", 7, first=30, max_tokens=10)
    s.add(a)
    s.add(b)
    step(s)  # a: blocks 0,1  b: blocks 2,3
    step(s)  # both compute position 7, the last slot of their second block
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    plan = step(s)  # a needs a third block for position 8: b is preempted
    assert shape(plan) == [("a", 8, 1, True)]
    assert b.status is SequenceStatus.WAITING and b.num_preemptions == 1
    assert list(s.waiting) == [b] and b.block_table == [] and b.num_computed_tokens == 0
    assert s.num_preemptions == 1


def test_preempted_sequence_resumes_from_its_cached_blocks():
    s = make(num_blocks=4, budget=64)
    a, b = seq("a", 7, max_tokens=3), seq("b", 7, first=30, max_tokens=3)
    s.add(a)
    s.add(b)
    step(s)
    step(s)
    step(s)  # b preempted; a gets its third token, finishes and frees its blocks
    assert a.is_finished and b.num_preemptions == 1
    plan = step(s)
    # b's blocks were freed last-first, so a's new block evicted b's second block (id 3);
    # b's first block is still cached and b recomputes from position 4.
    assert shape(plan) == [("b", 4, 5, True)]
    assert b.output_token_ids == [7, 7, 7] and b.num_cached_tokens == 0


def test_abort_frees_blocks_and_is_idempotent():
    s = make()
    a = seq("a", 10)
    s.add(a)
    step(s)
    assert s.abort("a") is a and a.finish_reason == "abort"
    assert s.block_manager.num_free_blocks == 16
    assert s.abort("a") is None


def test_abort_while_waiting():
    s = make()
    s.add(seq("a", 3))
    assert s.abort("a").finish_reason == "abort"
    assert not s.has_unfinished()


def test_prefix_cache_hit_skips_cached_tokens():
    s = make(budget=64)
    a = seq("a", 10, max_tokens=1)
    s.add(a)
    step(s)
    b = seq("b", 10, max_tokens=1)
    s.add(b)
    assert shape(step(s)) == [("b", 8, 2, True)]
    assert b.num_cached_tokens == 8


def test_waiting_request_that_does_not_fit_waits():
    s = make(num_blocks=3, budget=64)
    a = seq("a", 8, max_tokens=3)
    s.add(a)
    s.add(seq("b", 8, first=40))
    plan = step(s)
    assert [c.request_id for c in plan.chunks] == ["a"]
    assert [q.request_id for q in s.waiting] == ["b"]


def test_keep_blocks_holds_kv_after_finishing_until_released():
    s = make(budget=64)
    a = seq("a", 9, max_tokens=1)
    a.keep_blocks = True
    s.add(a)
    step(s)
    assert a.is_finished and a.finish_reason == "length"
    assert a.block_table == [0, 1, 2] and len(a.block_hashes) == 2
    assert s.block_manager.num_free_blocks == 13
    s.block_manager.release(a.block_table)
    assert s.block_manager.num_free_blocks == 16


def test_keep_blocks_is_ignored_on_abort():
    s = make(budget=64)
    a = seq("a", 9)
    a.keep_blocks = True
    s.add(a)
    step(s)
    s.abort("a")
    assert s.block_manager.num_free_blocks == 16


# ---- shortest-prefill policy ----------------------------------------------------------------


def make_sjf(budget=8, max_overtakes=16, num_blocks=64) -> Scheduler:
    config = SchedulerConfig(8, budget, 256, policy="shortest-prefill", max_overtakes=max_overtakes)
    return Scheduler(config, BlockManager(num_blocks, BS))


def test_unknown_scheduling_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="scheduling policy must be one of fcfs, shortest-prefill"):
        SchedulerConfig(policy="lifo")


def test_shortest_prefill_admits_the_fewest_uncomputed_tokens_first():
    s = make_sjf(budget=8)
    s.add(seq("long", 20, first=100))
    s.add(seq("short", 6, first=200))
    s.add(seq("mid", 10, first=300))
    # fcfs would give "long" the whole budget; here "short" (6) goes first, "mid" gets the rest
    assert shape(step(s)) == [("short", 0, 6, True), ("mid", 0, 2, False)]
    assert [q.request_id for q in s.waiting] == ["long"]


def test_shortest_prefill_counts_the_prefix_cache_as_computed():
    s = make_sjf(budget=64)
    s.add(seq("warm", 17, first=1))  # 4 full blocks published once it ran
    step(s)
    s.add(seq("cold", 12, first=500))
    s.add(seq("again", 20, first=1))  # 20 tokens, the first 16 cached: 4 left to compute
    plan = step(s)
    assert [(c.request_id, c.start_pos, c.num_tokens) for c in plan.chunks] == [
        ("warm", 17, 1),
        ("again", 16, 4),
        ("cold", 0, 12),
    ]


def test_shortest_prefill_never_passes_a_request_more_than_max_overtakes_times():
    s = make_sjf(budget=4, max_overtakes=2)
    s.add(seq("long", 40, first=1000, max_tokens=1))
    starts = []
    for i in range(3):  # a stream of short requests, each arriving after "long"
        s.add(seq(f"s{i}", 4, first=10 * i + 1, max_tokens=1))
        starts += [c.request_id for c in step(s).chunks if c.start_pos == 0]
    assert starts == ["s0", "s1", "long"]  # s2's turn went to "long", passed twice
    assert [q.request_id for q in s.waiting] == ["s2"]
    assert s.running[0].request_id == "long" and s.running[0].num_overtaken == 2
    assert shape(step(s)) == [("long", 4, 4, False)]  # once running, it keeps its chunks
