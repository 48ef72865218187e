"""Lending a prompt's cached blocks to a peer: the block manager's references and the lease
that hands them back (as the worker wires them: ``LeaseTable(on_end=release)``)."""

from __future__ import annotations

import pytest

from splitserve.common.kv_hash import hash_blocks, root_hash
from splitserve.engine.block_manager import BlockManager
from splitserve.transfer import LeaseNotFound, LeaseTable

BS = 4
ROOT = root_hash("test-model")
TOKENS = list(range(100, 114))  # three full blocks and a partial one


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def cached_pool(num_blocks: int = 8) -> tuple[BlockManager, list[bytes], list[int]]:
    """A pool whose prefix cache holds TOKENS' three full blocks, all free (ref 0)."""
    bm = BlockManager(num_blocks, BS)
    hashes = hash_blocks(TOKENS, ROOT, BS)
    ids = bm.reserve(len(hashes))
    assert ids is not None
    bm.register(ids, hashes, TOKENS)
    return bm, hashes, ids


def lender(bm: BlockManager, clock: Clock) -> tuple[LeaseTable, list[str]]:
    ended: list[str] = []

    def on_end(lease, reason) -> None:
        ended.append(reason)
        bm.release(list(lease.block_ids))  # asserts if a block were released twice

    return LeaseTable(on_end=on_end, clock=clock, default_ttl_s=5.0), ended


def refs(bm: BlockManager, ids: list[int]) -> list[int]:
    return [bm.blocks[i].ref_count for i in ids]


def test_take_cached_takes_the_leading_run_only():
    bm, hashes, ids = cached_pool()
    other = [*TOKENS[:4], 9, 9, 9, 9, *TOKENS[8:]]  # differs in the second block
    assert bm.take_cached(hash_blocks(other, ROOT, BS), other) == ids[:1]
    assert refs(bm, ids) == [1, 0, 0]
    assert bm.take_cached(hashes, TOKENS) == ids
    assert refs(bm, ids) == [2, 1, 1]


def test_take_cached_checks_the_tokens_not_just_the_hashes():
    bm, hashes, _ = cached_pool()
    assert bm.take_cached(hashes, [t + 1 for t in TOKENS]) == []
    assert bm.num_free_blocks == bm.num_blocks


def test_leased_blocks_are_neither_evicted_nor_reused():
    bm, hashes, ids = cached_pool()
    leased = bm.take_cached(hashes, TOKENS)
    free = bm.num_free_blocks
    assert free == bm.num_blocks - len(ids)
    assert bm.reserve(free + 1) is None
    taken = bm.reserve(free)  # every other block, evicting whatever they cached
    assert taken is not None and not set(taken) & set(leased)
    assert bm.cached_prefix(hashes, TOKENS) == len(ids)


def test_a_released_lease_drops_its_references_exactly_once():
    bm, hashes, ids = cached_pool()
    leases, ended = lender(bm, Clock())
    lease = leases.grant("peer-1", bm.take_cached(hashes, TOKENS), hashes)
    assert refs(bm, ids) == [1, 1, 1] and leases.leased_blocks() == 3
    leases.release("peer-1")
    assert ended == ["released"] and refs(bm, ids) == [0, 0, 0]
    with pytest.raises(LeaseNotFound):
        leases.release("peer-1")
    assert leases.expire(now=1e9) == []
    assert ended == ["released"] and lease.ended == "released"
    assert bm.num_free_blocks == bm.num_blocks and bm.cached_prefix(hashes, TOKENS) == 3


def test_an_expired_lease_drops_its_references_exactly_once():
    bm, hashes, ids = cached_pool()
    clock = Clock()
    leases, ended = lender(bm, clock)
    leases.grant("peer-1", bm.take_cached(hashes, TOKENS), hashes, ttl_s=2.0)
    clock.now = 1.0
    assert leases.expire() == [] and refs(bm, ids) == [1, 1, 1]
    clock.now = 2.5
    assert [lease.request_id for lease in leases.expire()] == ["peer-1"]
    assert ended == ["expired"] and refs(bm, ids) == [0, 0, 0]
    assert leases.expire() == []
    with pytest.raises(LeaseNotFound):
        leases.release("peer-1")
    assert ended == ["expired"]


def test_a_lease_being_read_outlives_its_deadline_and_ends_once_read():
    bm, hashes, ids = cached_pool()
    clock = Clock()
    leases, ended = lender(bm, clock)
    leases.grant("peer-1", bm.take_cached(hashes, TOKENS), hashes, ttl_s=2.0)
    with leases.checkout("peer-1"):
        clock.now = 10.0
        assert leases.expire() == [] and refs(bm, ids) == [1, 1, 1]
        leases.release("peer-1")  # the puller's release arrives while the read runs
        assert ended == [] and refs(bm, ids) == [1, 1, 1]
    assert ended == ["released"] and refs(bm, ids) == [0, 0, 0]
