"""The scheduler's half of the KV tier ladder, with a set standing in for the tier store."""

from __future__ import annotations

from splitserve.common.kv_hash import hash_blocks, root_hash
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.plan import StepResult
from splitserve.engine.scheduler import Scheduler, SchedulerConfig
from splitserve.engine.sequence import Sequence, SequenceStatus
from splitserve.engine.tiering import Admission, CopyDone, RetentionConfig, Tiering

BS = 4
ROOT = root_hash("m")


class Lower(set):
    """The tier store as the policy sees it: an index of held hashes."""

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(num_blocks=16, lower=None, retention=None, clock=None):
    bm = BlockManager(num_blocks, BS)
    tiering = Tiering(bm, lower, retention, clock or Clock())
    return Scheduler(SchedulerConfig(8, 64, 64), bm, tiering), tiering


def seq(rid: str, n: int, first: int = 1, **kw) -> Sequence:
    return Sequence(rid, list(range(first, first + n)), SamplingParams(max_tokens=1), ROOT, **kw)


def run(sched: Scheduler) -> None:
    """Step until nothing is scheduled, sampling token 7 for every sampled chunk."""
    while plan := sched.schedule():
        sched.update(plan, StepResult({c.request_id: 7 for c in plan.chunks if c.sample}))


def test_prefix_in_lower_tiers_is_loaded_before_admission():
    tokens = list(range(1, 19))  # 18 tokens: blocks 0..3 reusable (the last holds token 17)
    lower = Lower(hash_blocks(tokens, ROOT, BS)[:3])
    sched, tiering = make(lower=lower)
    s = seq("a", 18)
    sched.add(s)
    assert not sched.schedule()  # nothing runs: the sequence waits for its load
    assert tiering.loading == {"a": s} and sched.has_unfinished()
    [load] = tiering.take_copies()
    assert (load.kind, load.block_ids, load.token_ids) == ("load", [0, 1, 2], tokens[:12])
    assert load.hashes == hash_blocks(tokens, ROOT, BS)[:3]
    assert tiering.complete(CopyDone(load.copy_id, 3)) == [s]
    sched.resume(s)
    plan = sched.schedule()
    assert [(c.start_pos, c.num_tokens) for c in plan.chunks] == [(12, 6)]
    assert s.num_cached_tokens == 12 and s.block_table[:3] == [0, 1, 2]


def test_the_device_prefix_a_load_extends_is_not_evicted_for_it():
    # Block 0 of the prompt is still cached, the least recently used block in the pool; its
    # next blocks are one tier down. Reserving blocks for the load must not evict block 0,
    # or the loaded blocks would hang off a broken chain and the prompt be recomputed.
    tokens = list(range(1, 19))
    lower = Lower(hash_blocks(tokens, ROOT, BS)[1:4])
    sched, tiering = make(num_blocks=5, lower=lower)
    for first, n in ((1, 5), (100, 12)):  # block 0, then 3 blocks after it in the LRU order
        sched.add(seq(f"r{first}", n, first=first))
        run(sched)
        for save in tiering.take_copies():  # the saves land: no block is held by a copy
            tiering.complete(CopyDone(save.copy_id, len(save.block_ids)))
    s = seq("a", 18)
    sched.add(s)
    assert not sched.schedule()
    [load] = tiering.take_copies()
    assert load.kind == "load" and len(load.block_ids) == 3
    [resumed] = tiering.complete(CopyDone(load.copy_id, 3))
    sched.resume(resumed)
    plan = sched.schedule()
    assert [(c.start_pos, c.num_tokens) for c in plan.chunks] == [(16, 2)]
    assert s.num_cached_tokens == 16


def test_a_partial_load_registers_what_verified_and_recomputes_the_rest():
    lower = Lower(hash_blocks(list(range(1, 19)), ROOT, BS))
    sched, tiering = make(lower=lower)
    s = seq("a", 18)
    sched.add(s)
    sched.schedule()
    [load] = tiering.take_copies()
    assert len(load.block_ids) == 4  # reusable blocks only: never the one with the last token
    [resumed] = tiering.complete(CopyDone(load.copy_id, 1))  # block 1 failed its checksum
    sched.resume(resumed)
    plan = sched.schedule()
    assert [(c.start_pos, c.num_tokens) for c in plan.chunks] == [(4, 14)]
    assert tiering.stats.load_misses == 3 and tiering.stats.blocks_loaded == 1


def test_a_load_takes_the_free_blocks_there_are_and_waits_when_none():
    lower = Lower(hash_blocks(list(range(1, 19)), ROOT, BS))
    sched, tiering = make(num_blocks=3, lower=lower)
    a, b = seq("a", 18), seq("b", 18)  # the same prompt
    bm = sched.block_manager
    assert tiering.start_load(a, bm.match_prefix(a)) is Admission.LOADING
    [load] = tiering.take_copies()
    assert load.block_ids == [0, 1, 2]  # 3 of the 4 held below; the 4th is recomputed
    other = Lower(hash_blocks(list(range(100, 118)), ROOT, BS))
    tiering.lower = other
    c = seq("c", 18, first=100)
    assert tiering.start_load(c, bm.match_prefix(c)) is Admission.WAIT  # no block free
    assert not c.tier_checked
    assert tiering.start_load(b, bm.match_prefix(b)) is Admission.LOADING  # a's load brings it
    assert not tiering.take_copies() and set(tiering.loading) == {"a", "b"}
    d = seq("d", 18, first=200)
    assert tiering.start_load(d, bm.match_prefix(d)) is Admission.COMPUTE  # nothing below
    assert d.tier_checked and not tiering.take_copies()


def test_a_load_capped_by_free_blocks_brings_the_rest_once_it_lands():
    # 26 tokens: 6 reusable blocks, all one tier down; another request holds 3 of the 8
    # device blocks, so the first load takes the 5 free ones, and the sixth block comes in a
    # second load instead of being recomputed.
    tokens = list(range(1, 27))
    lower = Lower(hash_blocks(tokens, ROOT, BS)[:6])
    sched, tiering = make(num_blocks=8, lower=lower)
    other = seq("other", 12, first=100)
    sched.add(other)
    sched.schedule()  # "other" runs, holding 3 blocks
    s = seq("a", 26)
    sched.add(s)
    assert not sched.schedule().chunks[1:]  # "a" waits for its load
    [first] = [c for c in tiering.take_copies() if c.kind == "load"]
    assert len(first.block_ids) == 5 and not s.tier_checked
    sched.abort("other")
    [resumed] = tiering.complete(CopyDone(first.copy_id, 5))
    sched.resume(resumed)
    assert not sched.schedule().chunks  # the sixth block is on its way up
    [second] = [c for c in tiering.take_copies() if c.kind == "load"]
    assert second.hashes == hash_blocks(tokens, ROOT, BS)[5:6] and s.tier_checked
    [resumed] = tiering.complete(CopyDone(second.copy_id, 1))
    sched.resume(resumed)
    plan = sched.schedule()
    assert [(c.start_pos, c.num_tokens) for c in plan.chunks] == [(24, 2)]
    assert s.num_cached_tokens == 24 and tiering.stats.blocks_loaded == 6


def test_a_capped_load_with_a_miss_recomputes_from_the_miss():
    tokens = list(range(1, 27))
    lower = Lower(hash_blocks(tokens, ROOT, BS)[:6])
    sched, tiering = make(num_blocks=8, lower=lower)
    sched.add(seq("other", 12, first=100))
    sched.schedule()
    s = seq("a", 26)
    sched.add(s)
    sched.schedule()
    [load] = [c for c in tiering.take_copies() if c.kind == "load"]
    sched.abort("other")
    [resumed] = tiering.complete(CopyDone(load.copy_id, 2))  # block 2 failed its check
    assert resumed.tier_checked  # the tiers are not asked again for what failed
    sched.resume(resumed)
    plan = sched.schedule()
    assert [(c.start_pos, c.num_tokens) for c in plan.chunks] == [(8, 18)]


def test_a_request_waits_for_the_prefetch_that_brings_its_prefix():
    tokens = list(range(1, 19))
    sched, tiering = make(lower=Lower(hash_blocks(tokens, ROOT, BS)))
    assert tiering.prefetch(tokens, ROOT) == (0, 4)  # none held in the pool, 4 coming up
    [load] = tiering.take_copies()
    s = seq("a", 18)
    sched.add(s)
    sched.add(seq("b", 5, first=100))  # nothing cached anywhere: not held up behind "a"
    plan = sched.schedule()
    assert [c.request_id for c in plan.chunks] == ["b"] and tiering.loading == {"a": s}
    assert not tiering.take_copies()  # "a" waits for the prefetch, no second load
    sched.update(plan, StepResult({"b": 7}))
    for resumed in tiering.complete(CopyDone(load.copy_id, 4)):
        sched.resume(resumed)
    plan = sched.schedule()
    assert [(c.start_pos, c.num_tokens) for c in plan.chunks] == [(16, 2)]
    assert s.num_cached_tokens == 16


def test_completed_blocks_are_saved_once_and_held_until_the_copy_is_done():
    lower = Lower()
    sched, tiering = make(lower=lower)
    sched.add(seq("a", 9))
    run(sched)
    [save] = tiering.take_copies()
    assert (save.kind, save.block_ids) == ("save", [0, 1])
    bm = sched.block_manager
    assert [bm.blocks[i].ref_count for i in (0, 1)] == [1, 1]  # a finished; the save holds them
    lower.update(save.hashes)
    tiering.complete(CopyDone(save.copy_id, 2))
    assert [bm.blocks[i].ref_count for i in (0, 1)] == [0, 0]
    sched.add(seq("b", 9))
    run(sched)
    assert not tiering.take_copies()  # the same blocks again: already held below


def test_aborting_a_loading_sequence_still_lands_its_blocks():
    lower = Lower(hash_blocks(list(range(1, 19)), ROOT, BS))
    sched, tiering = make(lower=lower)
    sched.add(seq("a", 18))
    sched.schedule()
    [load] = tiering.take_copies()
    assert sched.abort("a").status is SequenceStatus.FINISHED
    assert sched.has_unfinished()  # until its load lands
    assert tiering.complete(CopyDone(load.copy_id, 4)) == []
    assert not sched.has_unfinished()
    assert sched.block_manager.match_prefix(seq("b", 18)).num_blocks == 4


def test_retention_pins_within_quota_then_expiry_demotes():
    clock = Clock()
    sched, tiering = make(retention=RetentionConfig(10.0, quota_blocks=2), clock=clock)
    s = seq("a", 13, retention_s=5.0, session_id="sess")
    sched.add(s)
    run(sched)
    bm = sched.block_manager
    assert tiering.pinned_blocks == 2  # 3 full blocks, quota 2: the leading two
    assert [bm.blocks[i].ref_count for i in range(4)] == [1, 1, 0, 0]
    clock.t = 4.9
    assert tiering.expire_pins() == 0
    clock.t = 5.0
    assert tiering.expire_pins() == 1 and tiering.pinned_blocks == 0
    assert list(bm._free)[:2] == [0, 1]  # demoted: first in line for eviction


def test_a_session_holds_one_pin_and_the_total_is_bounded():
    sched, tiering = make(retention=RetentionConfig(10.0, quota_blocks=8, max_pinned_blocks=3))
    for rid, first, session in (("a", 1, "s1"), ("b", 1, "s1"), ("c", 50, "s2")):
        sched.add(seq(rid, 9, first, retention_s=5.0, session_id=session))
        run(sched)
    # s1 re-pinned its 2 blocks once; s2's 2 more would exceed 3, so s1's older pin went.
    assert tiering.pinned_blocks == 2 and list(tiering._pins) == ["s2"]


def test_pin_takes_a_cached_prefix_within_quota_and_aborts_never_pin():
    # ``pin`` is what the serving layer uses after a reply that called tools.
    sched, tiering = make(retention=RetentionConfig(10.0, quota_blocks=2))
    a = seq("a", 9)
    sched.add(a)
    run(sched)
    bm = sched.block_manager
    cached = bm.cached_blocks(hash_blocks(list(range(1, 10)), ROOT, BS), list(range(1, 10)))
    assert cached == [0, 1]
    assert tiering.pin("s", cached + [5], 3.0) == 2  # quota: 2 blocks
    assert [bm.blocks[i].ref_count for i in (0, 1)] == [1, 1]
    assert tiering.pin("s", [], 3.0) == 0 and tiering.pinned_blocks == 0  # replaced, released
    b = seq("b", 9, first=50, retention_s=5.0)
    sched.add(b)
    sched.schedule()
    sched.abort("b")
    assert tiering.pinned_blocks == 0


def test_shortest_prefill_counts_what_lower_tiers_hold_as_not_to_compute():
    tokens = list(range(1, 22))  # 21 tokens; lower tiers hold blocks 0..3: 5 left to compute
    for policy, loading in (("fcfs", []), ("shortest-prefill", ["warm"])):
        bm = BlockManager(32, BS)
        tiering = Tiering(bm, Lower(hash_blocks(tokens, ROOT, BS)[:4]), None, Clock())
        sched = Scheduler(SchedulerConfig(8, 12, 64, policy=policy), bm, tiering)
        sched.add(seq("cold", 12, first=500))  # 12 to compute (the whole budget), first in line
        warm = seq("warm", 21)
        sched.add(warm)
        assert tiering.blocks_below(warm, bm.match_prefix(warm)) == 4
        assert [c.request_id for c in sched.schedule().chunks] == ["cold"]
        # fcfs: "cold" took the budget before "warm" was looked at; shortest-prefill: "warm"
        # went first and left the queue to wait for its load, then "cold" was admitted
        assert list(tiering.loading) == loading, policy


def test_unpin_holding_ends_only_the_pins_that_hold_an_erased_block():
    sched, tiering = make(retention=RetentionConfig(10.0))
    for rid, first, session in (("a", 1, "s1"), ("b", 50, "s2")):
        sched.add(seq(rid, 9, first, retention_s=5.0, session_id=session))
        run(sched)
    bm = sched.block_manager
    held = bm.cached_ids(hash_blocks(list(range(1, 9)), ROOT, BS))
    assert tiering.unpin_holding(held) == 1 and list(tiering._pins) == ["s2"]
    assert all(bm.blocks[b].ref_count == 0 for b in held)
    assert tiering.unpin_holding(held) == 0
