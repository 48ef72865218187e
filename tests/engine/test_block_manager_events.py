"""The block manager tells its ``events`` sink what the prefix cache gains and loses, as
vLLM's KV events do: stored runs chained to their parent, one removal per evicted block,
one ``cleared`` when a reset empties the cache."""

from __future__ import annotations

from splitserve.common.kv_hash import hash_blocks, root_hash
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.plan import StepResult
from splitserve.engine.scheduler import Scheduler, SchedulerConfig
from splitserve.engine.sequence import Sequence
from splitserve.engine.tiering import CopyDone, Tiering

BS = 4
ROOT = root_hash("test-model")


class Recorder:
    def __init__(self) -> None:
        self.log: list[tuple] = []

    def stored(self, hashes, parent, blocks, salt="") -> None:
        entry = ("stored", list(hashes), parent, [tuple(b) for b in blocks])
        self.log.append(entry + ((salt,) if salt else ()))

    def removed(self, block_hash) -> None:
        self.log.append(("removed", block_hash))

    def cleared(self) -> None:
        self.log.append(("cleared",))


def manager(num_blocks: int = 8) -> tuple[BlockManager, Recorder]:
    bm = BlockManager(num_blocks, BS)
    bm.events = Recorder()
    return bm, bm.events


def admit(bm: BlockManager, tokens: list[int], rid: str, root: bytes = ROOT) -> Sequence:
    seq = Sequence(rid, list(tokens), SamplingParams(), root)
    match = bm.match_prefix(seq)
    n = seq.num_tokens - match.num_blocks * BS
    bm.allocate(seq, match)
    bm.append_slots(seq, n)
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)
    return seq


def blocks_of(tokens: list[int]) -> list[tuple[int, ...]]:
    return [tuple(tokens[i : i + BS]) for i in range(0, len(tokens) // BS * BS, BS)]


def test_a_prompt_stores_its_full_blocks_as_one_run_from_the_root():
    bm, rec = manager()
    tokens = list(range(10))
    admit(bm, tokens, "a")
    h = hash_blocks(tokens, ROOT, BS)
    assert rec.log == [("stored", h, None, blocks_of(tokens))]


def test_a_growing_sequence_chains_each_new_run_to_its_last_block():
    bm, rec = manager()
    seq = admit(bm, list(range(6)), "a")  # block 0 full
    seq.token_ids += [6, 7, 8, 9, 10, 11]
    bm.append_slots(seq, 6)
    seq.num_computed_tokens += 6
    bm.cache_full_blocks(seq)  # blocks 1 and 2 complete
    h = hash_blocks(seq.token_ids, ROOT, BS)
    assert rec.log == [
        ("stored", h[:1], None, [(0, 1, 2, 3)]),
        ("stored", h[1:3], h[0], [(4, 5, 6, 7), (8, 9, 10, 11)]),
    ]


def test_a_prefix_hit_stores_only_the_blocks_it_computed():
    bm, rec = manager()
    admit(bm, list(range(9)), "a")  # blocks 0, 1
    rec.log.clear()
    b = list(range(8)) + [90, 91, 92, 93, 94]  # reuses 0, 1; computes block 2
    admit(bm, b, "b")
    h = hash_blocks(b, ROOT, BS)
    assert rec.log == [("stored", [h[2]], h[1], [(90, 91, 92, 93)])]


def test_a_block_another_sequence_cached_first_splits_the_run():
    bm, rec = manager(num_blocks=12)
    # Both computed in the same step: b's copy of block 1 is not kept (a's is), so b's
    # stored run is blocks 2.. only, chained to block 1's hash all the same.
    a = Sequence("a", list(range(8)) + [7], SamplingParams(), ROOT)
    b = Sequence("b", list(range(8)) + [50, 51, 52, 53, 54], SamplingParams(), ROOT)
    for seq in (a, b):
        bm.allocate(seq, bm.match_prefix(seq))
        bm.append_slots(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(a)
    rec.log.clear()
    bm.cache_full_blocks(b)
    h = hash_blocks(b.token_ids, ROOT, BS)
    assert rec.log == [("stored", [h[2]], h[1], [(50, 51, 52, 53)])]


def test_eviction_reports_each_removed_block():
    bm, rec = manager(num_blocks=4)
    a = admit(bm, list(range(9)), "a")
    bm.free(a)
    rec.log.clear()
    admit(bm, [50 + i for i in range(13)], "c")  # needs all 4 blocks: evicts 1, then 0
    h = hash_blocks(list(range(9)), ROOT, BS)
    removed = [e for e in rec.log if e[0] == "removed"]
    assert removed == [("removed", h[1]), ("removed", h[0])]


def test_register_reports_new_blocks_chained_to_the_given_parent():
    bm, rec = manager()
    tokens = list(range(16))
    h = hash_blocks(tokens, ROOT, BS)
    ids = bm.reserve(2)
    bm.register(ids, h[2:4], tokens, start_block=2, parent=h[1])
    assert rec.log == [("stored", h[2:4], h[1], [(8, 9, 10, 11), (12, 13, 14, 15)])]


def test_register_skips_blocks_already_cached():
    bm, rec = manager()
    tokens = list(range(12))
    admit(bm, tokens[:5], "a")  # block 0 cached
    rec.log.clear()
    h = hash_blocks(tokens, ROOT, BS)
    ids = bm.reserve(3)
    bm.register(ids, h, tokens, parent=None)
    assert rec.log == [("stored", h[1:3], h[0], [(4, 5, 6, 7), (8, 9, 10, 11)])]


def test_reset_of_an_idle_cache_is_one_cleared_event():
    bm, rec = manager()
    bm.free(admit(bm, list(range(9)), "a"))
    rec.log.clear()
    bm.reset_prefix_cache()
    assert rec.log == [("cleared",)]
    assert bm.num_cached_blocks == 0


def test_reset_with_blocks_in_use_reports_only_the_evicted_ones():
    bm, rec = manager()
    bm.free(admit(bm, list(range(5)), "a"))  # block 0 of a: free, cached
    admit(bm, [50 + i for i in range(5)], "b")  # in use: stays cached
    rec.log.clear()
    bm.reset_prefix_cache()
    assert rec.log == [("removed", hash_blocks(list(range(4)), ROOT, BS)[0])]
    assert bm.num_cached_blocks == 1


def test_without_a_sink_nothing_is_reported_and_nothing_changes():
    quiet, loud = BlockManager(8, BS), manager()[0]
    for bm in (quiet, loud):
        bm.free(admit(bm, list(range(9)), "a"))
        admit(bm, [50 + i for i in range(30)], "c")
    assert quiet._hash == loud._hash and list(quiet._free) == list(loud._free)


class Lower(set):
    """A tier store as the tiering policy sees it: an index of held hashes."""

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self


def test_a_tier_load_is_stored_chained_to_the_device_prefix_it_extends():
    tokens = list(range(1, 19))  # blocks 0..3 reusable
    h = hash_blocks(tokens, ROOT, BS)
    bm = BlockManager(16, BS)
    tiering = Tiering(bm, Lower(h[1:4]), None, lambda: 0.0)
    sched = Scheduler(SchedulerConfig(8, 64, 64), bm, tiering)
    sched.add(Sequence("r", tokens[:5], SamplingParams(max_tokens=1), ROOT))  # block 0
    while plan := sched.schedule():
        sched.update(plan, StepResult({c.request_id: 7 for c in plan.chunks if c.sample}))
    for save in tiering.take_copies():
        tiering.complete(CopyDone(save.copy_id, len(save.block_ids)))
    bm.events = rec = Recorder()
    sched.add(Sequence("a", tokens, SamplingParams(max_tokens=1), ROOT))
    assert not sched.schedule()  # waits for blocks 1..3 to come up
    [load] = tiering.take_copies()
    tiering.complete(CopyDone(load.copy_id, 3))
    assert rec.log == [("stored", h[1:4], h[0], blocks_of(tokens)[1:4])]


def test_a_salted_chains_first_block_is_stored_with_its_salt():
    # As vLLM's events carry a request's cache_salt: the router tells tenants' blocks apart.
    bm, rec = manager()
    salted = root_hash("test-model", "tenant-salt")
    bm.note_salt(salted, "tenant-salt")
    tokens = list(range(10))
    seq = admit(bm, tokens, "a", salted)
    h = hash_blocks(tokens, salted, BS)
    assert rec.log == [("stored", h, None, blocks_of(tokens), "tenant-salt")]
    seq.token_ids += [10, 11]  # the chain grows: a run with a parent carries no salt
    bm.append_slots(seq, 2)
    seq.num_computed_tokens += 2
    bm.cache_full_blocks(seq)
    assert rec.log[-1][2] == h[-1] and len(rec.log[-1]) == 4
    admit(bm, [50 + t for t in range(4)], "b")  # unsalted: no salt
    assert len(rec.log[-1]) == 4


def test_register_of_a_salted_chains_first_block_carries_the_salt():
    bm, rec = manager()
    salted = root_hash("test-model", "s1")
    bm.note_salt(salted, "s1")
    tokens = list(range(8))
    h = hash_blocks(tokens, salted, BS)
    ids = bm.reserve(2)
    bm.register(ids, h, tokens, root=salted)
    assert rec.log == [("stored", h, None, blocks_of(tokens), "s1")]
