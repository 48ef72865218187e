from __future__ import annotations

import numpy as np
import pytest

from splitserve.common.kv_hash import hash_blocks, root_hash
from splitserve.kvstore import BlockMeta, HostTier, TierUsage

HASHES = hash_blocks(list(range(16 * 8)), root_hash("test-model"))


def test_lru_eviction_order_exact():
    evicted: list[bytes] = []
    tier = HostTier(300, on_evict=lambda items: evicted.extend(h for h, _ in items))
    for h in HASHES[:3]:
        assert tier.put(h, bytes(100))
    assert tier.get(HASHES[0]) == bytes(100)  # 0 is now the most recent: order 1, 2, 0
    assert tier.put(HASHES[3], bytes(100))
    assert evicted == [HASHES[1]]
    assert tier.put(HASHES[4], bytes(150))  # needs two blocks of room
    assert evicted == [HASHES[1], HASHES[2], HASHES[0]]
    assert tier.lru_order() == [HASHES[3], HASHES[4]]
    assert tier.usage() == TierUsage(250, 300, 2)


def test_put_existing_refreshes_recency_without_double_counting():
    tier = HostTier(200)
    tier.put(HASHES[0], b"a" * 100)
    tier.put(HASHES[1], b"b" * 100)
    tier.put(HASHES[0], b"a" * 100)
    assert tier.lru_order() == [HASHES[1], HASHES[0]]
    assert tier.usage().bytes_used == 200


def test_block_larger_than_capacity_is_refused():
    tier = HostTier(10)
    assert not tier.put(HASHES[0], bytes(11))
    assert tier.get(HASHES[0]) is None


def test_numpy_roundtrip_and_meta():
    arr = np.arange(24, dtype=np.float16).reshape(2, 3, 4)
    tier = HostTier(1 << 20)
    tier.put(HASHES[0], arr)
    block = tier.load(HASHES[0])
    assert block.meta == BlockMeta("<f2", (2, 3, 4))
    np.testing.assert_array_equal(block.to_numpy(), arr)


def test_meta_size_mismatch_is_rejected():
    with pytest.raises(ValueError, match="implies 8 bytes"):
        HostTier(100).put(HASHES[0], bytes(6), BlockMeta("<f2", (4,)))


def test_evict_and_contains():
    tier = HostTier(100)
    tier.put(HASHES[0], bytes(10))
    assert tier.contains(HASHES[0])
    assert tier.evict(HASHES[0]) and not tier.evict(HASHES[0])
    assert not tier.contains(HASHES[0]) and tier.usage() == TierUsage(0, 100, 0)
