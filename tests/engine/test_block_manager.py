from __future__ import annotations

import pytest

from splitserve.common.kv_hash import BlockChain, hash_blocks, root_hash
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.sequence import Sequence

BS = 4
ROOT = root_hash("test-model")


def make_seq(tokens: list[int], rid: str = "r", root: bytes = ROOT) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(), root)


def admit(bm: BlockManager, seq: Sequence) -> None:
    """Allocate like the scheduler does, then mark every token computed."""
    match = bm.match_prefix(seq)
    n = seq.num_tokens - match.num_blocks * BS
    assert bm.can_allocate(match, n, seq)
    bm.allocate(seq, match)
    bm.append_slots(seq, n)
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)


def test_allocate_takes_blocks_in_order():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(list(range(10)))
    admit(bm, seq)
    assert seq.block_table == [0, 1, 2]
    assert [bm.blocks[i].ref_count for i in range(4)] == [1, 1, 1, 0]
    assert bm.num_free_blocks == 5
    # Two full blocks are hashed; the partial third is not.
    assert seq.block_hashes == hash_blocks(seq.token_ids, ROOT, BS)
    assert len(seq.block_hashes) == 2 and bm.blocks[2].hash is None


def test_prefix_hit_shares_blocks_and_counts_refs():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(list(range(10)), "a")
    admit(bm, a)
    b = make_seq(list(range(8)) + [99, 98, 97], "b")
    match = bm.match_prefix(b)
    assert match.block_ids == [0, 1]
    admit(bm, b)
    assert b.block_table == [0, 1, 3]
    assert b.num_computed_tokens == 11
    assert [bm.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    assert (bm.prefix_queries, bm.prefix_hits) == (2 + 2, 2)


def test_fully_cached_prompt_recomputes_last_block():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(list(range(8)), "a")
    admit(bm, a)
    b = make_seq(list(range(8)), "b")
    # 8 tokens = 2 full blocks, but at least one token must be computed: only block 0 reused.
    assert bm.match_prefix(b).block_ids == [0]


def test_free_keeps_hash_and_evicts_lazily_lru():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(list(range(9)), "a")  # blocks 0,1 full (hashed), 2 partial
    admit(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    # Unhashed block 2 goes to the head; hashed ones are appended last-block-first.
    assert list(bm._free) == [2, 3, 1, 0]
    b = make_seq(list(range(9)), "b")
    assert bm.match_prefix(b).block_ids == [0, 1]  # still cached after free
    c = make_seq([50 + i for i in range(13)], "c")  # needs 4 blocks: evicts 1 and 0
    admit(bm, c)
    assert c.block_table == [2, 3, 1, 0]
    assert bm.match_prefix(b).block_ids == []


def test_eviction_order_prefers_unhashed_then_oldest():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = make_seq(list(range(5)), "a")  # block 0 hashed, block 1 partial
    admit(bm, a)
    b = make_seq([100 + i for i in range(5)], "b")  # block 2 hashed, block 3 partial
    admit(bm, b)
    bm.free(a)
    bm.free(b)
    assert list(bm._free) == [3, 1, 4, 5, 0, 2]


def test_salts_never_share():
    bm = BlockManager(num_blocks=8, block_size=BS)
    admit(bm, make_seq(list(range(9)), "a", root=root_hash("test-model", "tenant-a")))
    other = make_seq(list(range(9)), "b", root=root_hash("test-model", "tenant-b"))
    assert bm.match_prefix(other).block_ids == []


def test_hash_collision_is_not_served():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(list(range(9)), "a")
    admit(bm, a)
    # Corrupt the stored tokens to simulate a collision: the hash matches, the tokens do not.
    bm.blocks[0].token_ids = (9, 9, 9, 9)
    assert bm.match_prefix(make_seq(list(range(9)), "b")).block_ids == []


def test_duplicate_block_keeps_first_owner():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = make_seq(list(range(5)), "a"), make_seq(list(range(5)), "b")
    for s in (a, b):  # both miss, then both compute the same block
        bm.allocate(s, bm.match_prefix(s))
    for s in (a, b):
        bm.append_slots(s, 4)
        s.num_computed_tokens = 4
        bm.cache_full_blocks(s)
    assert bm._cached[a.block_hashes[0]] == a.block_table[0]
    assert bm.blocks[b.block_table[0]].hash is None
    assert a.block_hashes == b.block_hashes


def test_can_append_counts_free_blocks():
    bm = BlockManager(num_blocks=2, block_size=BS)
    seq = make_seq(list(range(4)), "a")
    admit(bm, seq)  # 4 computed tokens fill block 0
    assert bm.can_append(seq, 4)  # positions 4..7 need block 1
    assert not bm.can_append(seq, 5)
    with pytest.raises(RuntimeError):
        bm.append_slots(seq, 5)


def test_reset_prefix_cache():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(list(range(9)), "a")
    admit(bm, a)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.match_prefix(make_seq(list(range(9)), "b")).block_ids == []


def test_reserve_register_publishes_blocks_into_the_prefix_cache():
    bm = BlockManager(num_blocks=6, block_size=BS)
    tokens = list(range(12))
    hashes = hash_blocks(tokens, ROOT, BS)
    assert bm.cached_prefix(hashes, tokens) == 0
    reserved = bm.reserve(3)
    assert reserved == [0, 1, 2] and bm.num_free_blocks == 3
    bm.register(reserved, hashes, tokens)
    assert bm.num_free_blocks == 6  # released into the cache, ref 0
    assert bm.cached_prefix(hashes, tokens) == 3
    seq = make_seq(tokens + [99])
    assert bm.match_prefix(seq).block_ids == [0, 1, 2]


def test_cached_prefix_stops_at_first_miss_and_checks_tokens():
    bm = BlockManager(num_blocks=6, block_size=BS)
    tokens = list(range(12))
    admit(bm, make_seq(tokens[:8]))
    hashes = hash_blocks(tokens, ROOT, BS)
    assert bm.cached_prefix(hashes, tokens) == 2
    assert bm.cached_prefix(hashes, [7] * 12) == 0  # same hashes, other tokens: a miss


def test_reserve_fails_cleanly_and_release_returns_blocks():
    bm = BlockManager(num_blocks=2, block_size=BS)
    assert bm.reserve(3) is None and bm.num_free_blocks == 2
    ids = bm.reserve(2)
    bm.release(ids)
    assert bm.num_free_blocks == 2


def test_register_from_a_later_block():
    bm = BlockManager(num_blocks=6, block_size=BS)
    tokens = list(range(12))
    hashes = hash_blocks(tokens, ROOT, BS)
    admit(bm, make_seq(tokens[:4]))  # block 0 cached here already
    reserved = bm.reserve(2)
    bm.register(reserved, hashes[1:], tokens, start_block=1)
    assert bm.cached_prefix(hashes, tokens) == 3


def test_register_with_a_chains_blocks_stores_its_very_tuples():
    # The simulator's KV pulls hand over the session chain's token tuples: a later lookup
    # through that chain finds them by identity, and one through a fresh chain still hits.
    bm = BlockManager(num_blocks=6, block_size=BS)
    tokens = list(range(12))
    chain = BlockChain(ROOT, BS)
    chain.extend(tokens, 3)
    reserved = bm.reserve(2)
    bm.register(reserved, chain.hashes[1:], [], start_block=1, blocks=chain.tokens[1:])
    assert [bm._tokens[b] for b in reserved] == chain.tokens[1:]
    assert all(bm._tokens[b] is t for b, t in zip(reserved, chain.tokens[1:], strict=True))
    admit(bm, make_seq(tokens[:4], "a"))  # block 0 computed here
    assert bm.match_prefix(make_seq(tokens + [99], "b")).num_blocks == 3
    assert bm.cached_prefix(chain.hashes, [7] * 12) == 0  # other tokens: still a miss


def test_a_chain_carried_from_an_earlier_turn_matches_like_a_fresh_one():
    # The simulator hands a session's next turn the chain its previous turn grew; matching
    # and caching with it must give exactly what hashing from scratch gives.
    bm = BlockManager(num_blocks=16, block_size=BS)
    first = make_seq(list(range(10)), "t0")
    admit(bm, first)
    turn = list(range(10)) + [70, 71, 72, 73, 74, 75]
    carried = Sequence("t1", list(turn), SamplingParams(), ROOT, chain=first.chain)
    fresh = make_seq(turn, "fresh")
    assert bm.match_prefix(carried) == bm.match_prefix(fresh)
    assert carried.chain is first.chain
    admit(bm, carried)
    assert carried.block_hashes == hash_blocks(turn, ROOT, BS)


def test_a_chain_of_another_block_size_or_root_is_replaced():
    other = BlockManager(num_blocks=8, block_size=2 * BS)
    seq = make_seq(list(range(20)), "a")
    other.match_prefix(seq)
    bm = BlockManager(num_blocks=8, block_size=BS)
    admit(bm, seq)
    assert seq.block_hashes == hash_blocks(seq.token_ids, ROOT, BS)
    salted = make_seq(list(range(20)), "b", root=root_hash("test-model", "tenant"))
    salted.chain = seq.chain
    assert bm.match_prefix(salted).block_ids == []


def test_uncache_evicts_free_blocks_first_in_line_and_reports_blocks_in_use():
    bm = BlockManager(num_blocks=8, block_size=BS)
    done, running = make_seq(list(range(9)), "done"), make_seq(list(range(100, 109)), "run")
    admit(bm, done)
    admit(bm, running)
    bm.free(done)
    hashes = hash_blocks(list(range(9)), ROOT, BS) + hash_blocks(list(range(100, 109)), ROOT, BS)
    freed, in_use = bm.uncache(hashes + [b"\0" * 16])
    assert freed == [0, 1] and in_use == running.block_hashes
    assert bm.blocks[0].hash is None and bm.num_cached_blocks == 2
    assert list(bm._free)[:2] == [1, 0]  # reused before any cached block
    assert bm.cached_ids(hashes) == set(running.block_table[:2])
