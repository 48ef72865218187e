from __future__ import annotations

import os

import numpy as np
import pytest

from splitserve.common.kv_hash import hash_blocks, root_hash
from splitserve.kvstore import DiskTier, KeyRing
from splitserve.kvstore.disk import PREFIX_BYTES
from splitserve.kvstore.keyring import key_id
from splitserve.kvstore.reseal import reseal_directory

HASHES = hash_blocks(list(range(16 * 8)), root_hash("test-model"))
KEY = bytes(range(32))
FILE = PREFIX_BYTES + 100  # one 100-byte plaintext block on disk


def payload(i: int) -> bytes:
    return bytes([i]) * 100


def block_files(directory) -> list:
    return sorted(p for p in directory.rglob("*.kvb"))


def test_roundtrip_numpy(tmp_path):
    arr = np.random.default_rng(0).standard_normal((2, 4, 8)).astype(np.float32)
    tier = DiskTier(tmp_path, 1 << 20, "m")
    assert tier.put(HASHES[0], arr)
    np.testing.assert_array_equal(tier.load(HASHES[0]).to_numpy(), arr)
    assert block_files(tmp_path)[0].parent.name == HASHES[0].hex()[:2]


def test_survives_reopen_with_lru_order(tmp_path):
    tier = DiskTier(tmp_path, 3 * FILE, "m")
    for i in range(3):
        tier.put(HASHES[i], payload(i))
        os.utime(tier._path(HASHES[i]), (1000 + i, 1000 + i))
    os.utime(tier._path(HASHES[0]), (2000, 2000))  # 0 was used last before the restart
    reopened = DiskTier(tmp_path, 3 * FILE, "m")
    assert reopened.usage().blocks == 3
    assert reopened.get(HASHES[2]) == payload(2)
    reopened.put(HASHES[3], payload(3))  # evicts the oldest access: block 1
    assert not reopened.contains(HASHES[1])
    assert [reopened.contains(HASHES[i]) for i in (0, 2, 3)] == [True, True, True]


def test_flipped_byte_is_a_miss_and_removes_the_file(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20, "m")
    tier.put(HASHES[0], payload(7))
    path = tier._path(HASHES[0])
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0x01
    path.write_bytes(bytes(raw))
    assert tier.get(HASHES[0]) is None
    assert tier.stats.checksum_failures == 1
    assert not path.exists() and tier.usage().blocks == 0


def test_wrong_key_is_a_miss_not_an_exception(tmp_path):
    DiskTier(tmp_path, 1 << 20, "m", key=KEY).put(HASHES[0], payload(1))
    other = DiskTier(tmp_path, 1 << 20, "m", key=bytes(32))
    assert other.usage().blocks == 1  # the scan cannot tell a wrong key; the read can
    assert other.get(HASHES[0]) is None
    assert other.stats.decrypt_failures == 1 and not block_files(tmp_path)


def test_right_key_reads_after_reopen(tmp_path):
    DiskTier(tmp_path, 1 << 20, "m", key=KEY).put(HASHES[0], payload(1))
    assert DiskTier(tmp_path, 1 << 20, "m", key=KEY).get(HASHES[0]) == payload(1)


def test_encrypted_file_does_not_contain_plaintext(tmp_path):
    secret = np.arange(256, dtype=np.float32)
    tier = DiskTier(tmp_path, 1 << 20, "m", key=KEY)
    tier.put(HASHES[0], secret)
    raw = block_files(tmp_path)[0].read_bytes()
    assert secret.tobytes()[:64] not in raw and secret.tobytes()[-64:] not in raw
    np.testing.assert_array_equal(tier.load(HASHES[0]).to_numpy(), secret)


def test_two_encryptions_of_one_block_differ(tmp_path):
    a = DiskTier(tmp_path / "a", 1 << 20, "m", key=KEY)
    b = DiskTier(tmp_path / "b", 1 << 20, "m", key=KEY)
    a.put(HASHES[0], payload(1))
    b.put(HASHES[0], payload(1))
    assert (
        block_files(tmp_path / "a")[0].read_bytes() != block_files(tmp_path / "b")[0].read_bytes()
    )


def test_plaintext_file_is_refused_when_a_key_is_configured(tmp_path):
    DiskTier(tmp_path, 1 << 20, "m").put(HASHES[0], payload(1))
    keyed = DiskTier(tmp_path, 1 << 20, "m", key=KEY)
    assert keyed.get(HASHES[0]) is None and not block_files(tmp_path)


def test_other_model_id_is_a_miss(tmp_path):
    DiskTier(tmp_path, 1 << 20, "model-a").put(HASHES[0], payload(1))
    other = DiskTier(tmp_path, 1 << 20, "model-b")
    assert other.get(HASHES[0]) is None
    assert other.stats.dropped_at_scan == 1 and not block_files(tmp_path)


def test_file_renamed_to_another_hash_is_a_miss(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20, "m")
    tier.put(HASHES[0], payload(1))
    target = tier._path(HASHES[1])
    target.parent.mkdir(exist_ok=True)
    tier._path(HASHES[0]).rename(target)
    reopened = DiskTier(tmp_path, 1 << 20, "m")
    assert reopened.get(HASHES[1]) is None and reopened.usage().blocks == 0


def test_scan_drops_garbage_and_temp_files(tmp_path):
    DiskTier(tmp_path, 1 << 20, "m").put(HASHES[0], payload(1))
    shard = tmp_path / "ab"
    shard.mkdir()
    (shard / ("ab" * 16 + ".kvb")).write_bytes(b"not a block")
    (shard / ".x.kvb.123.tmp").write_bytes(b"half written")
    tier = DiskTier(tmp_path, 1 << 20, "m")
    assert tier.usage().blocks == 1 and tier.stats.dropped_at_scan == 2
    assert sorted(p.name for p in shard.iterdir()) == []


def test_capacity_bound_on_disk(tmp_path):
    tier = DiskTier(tmp_path, 3 * FILE + 50, "m")
    for i in range(6):
        assert tier.put(HASHES[i], payload(i))
        assert tier.usage().bytes_used <= tier.capacity_bytes
    assert tier.usage().blocks == 3
    assert sum(p.stat().st_size for p in block_files(tmp_path)) == tier.usage().bytes_used
    assert [tier.contains(h) for h in HASHES[:6]] == [False] * 3 + [True] * 3
    assert not tier.put(HASHES[7], bytes(4 * FILE))


def test_reopen_with_smaller_capacity_evicts_down_to_it(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20, "m")
    for i in range(4):
        tier.put(HASHES[i], payload(i))
    smaller = DiskTier(tmp_path, 2 * FILE, "m")
    assert smaller.usage().blocks == 2 and len(block_files(tmp_path)) == 2


def test_bad_key_length_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="32 bytes"):
        DiskTier(tmp_path, 100, "m", key=b"short")


# -- key rotation ------------------------------------------------------------------------

KEY_B = bytes([7]) * 32


def key_id_of(path) -> bytes:
    from splitserve.kvstore.disk import _Header

    return _Header.unpack(path.read_bytes()[: PREFIX_BYTES - 8]).key_id


def test_blocks_carry_their_key_id_and_old_keys_stay_readable(tmp_path):
    a = DiskTier(tmp_path, 1 << 20, "m", key=KEY)
    a.put(HASHES[0], payload(1))
    a.close()
    rotated = DiskTier(tmp_path, 1 << 20, "m", key=KeyRing.of(KEY_B, KEY))
    assert rotated.get(HASHES[0]) == payload(1)  # sealed with the old key: still a hit
    rotated.put(HASHES[1], payload(2))  # new writes: the current key
    assert key_id_of(rotated._path(HASHES[0])) == key_id(KEY)
    assert key_id_of(rotated._path(HASHES[1])) == key_id(KEY_B)


def test_reseal_then_drop_the_old_key(tmp_path):
    a = DiskTier(tmp_path, 1 << 20, "m", key=KEY)
    for i in range(3):
        a.put(HASHES[i], payload(i))
    a.close()
    ring = KeyRing.of(KEY_B, KEY)
    report = reseal_directory(tmp_path, ring)
    assert (report.resealed, report.already_current, report.missing_key) == (3, 0, 0)
    assert reseal_directory(tmp_path, ring).already_current == 3
    only_b = DiskTier(tmp_path, 1 << 20, "m", key=KEY_B)
    assert [only_b.get(h) for h in HASHES[:3]] == [payload(i) for i in range(3)]
    assert sorted(p.stat().st_size for p in block_files(tmp_path)) == [FILE + 16] * 3


def test_reseal_keeps_access_times(tmp_path):
    a = DiskTier(tmp_path, 1 << 20, "m", key=KEY)
    a.put(HASHES[0], payload(1))
    os.utime(a._path(HASHES[0]), (1234, 1234))
    a.close()
    reseal_directory(tmp_path, KeyRing.of(KEY_B, KEY))
    assert os.stat(block_files(tmp_path)[0]).st_mtime == 1234


def test_reseal_seals_plaintext_and_leaves_blocks_of_missing_keys(tmp_path):
    DiskTier(tmp_path / "p", 1 << 20, "m").put(HASHES[0], payload(1))
    report = reseal_directory(tmp_path / "p", KeyRing.of(KEY_B))
    assert report.resealed == 1
    assert DiskTier(tmp_path / "p", 1 << 20, "m", key=KEY_B).get(HASHES[0]) == payload(1)
    DiskTier(tmp_path / "q", 1 << 20, "m", key=KEY).put(HASHES[0], payload(1))
    report = reseal_directory(tmp_path / "q", KeyRing.of(KEY_B))
    assert (report.resealed, report.missing_key) == (0, 1)


def test_block_whose_key_left_the_file_is_a_miss_not_a_crash(tmp_path):
    a = DiskTier(tmp_path, 1 << 20, "m", key=KEY)
    a.put(HASHES[0], payload(1))
    a.close()
    only_b = DiskTier(tmp_path, 1 << 20, "m", key=KEY_B)
    assert only_b.load(HASHES[0]) is None
    assert only_b.stats.decrypt_failures == 1 and not block_files(tmp_path)


def test_reseal_refuses_a_directory_a_worker_holds(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20, "m", key=KEY)
    tier.put(HASHES[0], payload(1))
    with pytest.raises(ValueError, match="in use by a running worker"):
        reseal_directory(tmp_path, KeyRing.of(KEY_B, KEY))
    assert key_id_of(tier._path(HASHES[0])) == key_id(KEY)
    tier.close()
    assert reseal_directory(tmp_path, KeyRing.of(KEY_B, KEY)).resealed == 1


def test_block_files_of_the_keyless_format_are_dropped_at_the_scan(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20, "m")
    tier.put(HASHES[0], payload(1))
    path = tier._path(HASHES[0])
    raw = bytearray(path.read_bytes())
    raw[4:6] = (1).to_bytes(2, "little")  # format version 1
    path.write_bytes(bytes(raw))
    reopened = DiskTier(tmp_path, 1 << 20, "m")
    assert reopened.usage().blocks == 0 and reopened.stats.dropped_at_scan == 1
