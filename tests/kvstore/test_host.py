from __future__ import annotations

import numpy as np
import pytest

from splitserve.common.kv_hash import hash_blocks, root_hash
from splitserve.kvstore import BlockMeta, HostTier, KeyRing, TierUsage
from splitserve.kvstore.keyring import key_id

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


# -- the encrypted host tier ---------------------------------------------------------------

KEY_A, KEY_B = bytes(range(32)), bytes([7]) * 32


def held_bytes(tier: HostTier) -> list[bytes]:
    """What the tier keeps in RAM per block."""
    return [entry.data for entry in tier._blocks.values()]


def test_encrypted_roundtrip_holds_no_plaintext_in_ram():
    arr = np.random.default_rng(0).standard_normal((2, 4, 16)).astype(np.float32)
    tier = HostTier(1 << 20, keyring=KeyRing.of(KEY_A))
    assert tier.put(HASHES[0], arr)
    np.testing.assert_array_equal(tier.load(HASHES[0]).to_numpy(), arr)
    (held,) = held_bytes(tier)
    plain = arr.tobytes()
    assert len(held) == len(plain) + 16 and held != plain
    assert not any(plain[i : i + 16] in held for i in range(0, len(plain), 64))
    assert tier.usage() == TierUsage(len(plain) + 16, 1 << 20, 1)


def test_two_seals_of_one_block_differ():
    a, b = (HostTier(1 << 20, keyring=KeyRing.of(KEY_A)) for _ in range(2))
    a.put(HASHES[0], bytes(100))
    b.put(HASHES[0], bytes(100))
    assert held_bytes(a) != held_bytes(b)


def test_evicted_blocks_reach_the_listener_as_plaintext():
    evicted: list = []
    tier = HostTier(2 * 116, on_evict=evicted.extend, keyring=KeyRing.of(KEY_A))
    for i in range(3):
        tier.put(HASHES[i], bytes([i]) * 100)
    assert [(h, b.data, b.meta) for h, b in evicted] == [
        (HASHES[0], bytes(100), BlockMeta("|u1", (100,)))
    ]


def test_blocks_of_an_old_key_open_and_new_ones_use_the_current_key():
    tier = HostTier(1 << 20, keyring=KeyRing.of(KEY_A))
    tier.put(HASHES[0], b"a" * 100)
    tier.keyring = KeyRing.of(KEY_B, KEY_A)  # a rotated ring
    tier.put(HASHES[1], b"b" * 100)
    assert [e.key_id for e in tier._blocks.values()] == [key_id(KEY_A), key_id(KEY_B)]
    assert tier.get(HASHES[0]) == b"a" * 100 and tier.get(HASHES[1]) == b"b" * 100


def test_missing_key_or_tampered_block_is_a_miss_that_drops_it():
    tier = HostTier(1 << 20, keyring=KeyRing.of(KEY_A))
    tier.put(HASHES[0], b"a" * 100)
    tier.put(HASHES[1], b"b" * 100)
    entry = tier._blocks[HASHES[1]]
    tier._blocks[HASHES[1]] = entry._replace(meta=BlockMeta("|u1", (50, 2)))  # not what it sealed
    tier.keyring = KeyRing.of(KEY_B, KEY_A)
    assert tier.get(HASHES[1]) is None
    tier.keyring = KeyRing.of(KEY_B)
    assert tier.get(HASHES[0]) is None
    assert tier.decrypt_failures == 2 and tier.usage().blocks == 0
