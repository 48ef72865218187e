from __future__ import annotations

import threading

import numpy as np
import pytest

from splitserve.common.kv_hash import hash_blocks, root_hash
from splitserve.kvstore import DiskTier, HostTier, TieredStore
from splitserve.kvstore.disk import PREFIX_BYTES

HASHES = hash_blocks(list(range(16 * 64)), root_hash("test-model"))


def payload(i: int) -> bytes:
    return bytes([i % 256]) * 100


@pytest.fixture
def store(tmp_path):
    host = HostTier(300)
    disk = DiskTier(tmp_path, 1 << 20, "m")
    s = TieredStore([host, disk], write_through=False)
    yield s
    s.close(5)


def test_host_evictions_are_demoted_to_disk(store):
    host, disk = store.tiers
    for i in range(5):
        store.put(HASHES[i], payload(i))
    assert store.flush(5)
    assert host.lru_order() == HASHES[2:5]
    assert [disk.contains(h) for h in HASHES[:5]] == [True, True, False, False, False]
    assert store.stats.demotions == 2


def test_disk_hit_is_promoted_into_host(store):
    host, disk = store.tiers
    for i in range(5):
        store.put(HASHES[i], payload(i))
    store.flush(5)
    assert store.get(HASHES[0]) == payload(0)
    assert store.stats.hits == [0, 1] and store.stats.promotions == 1
    assert host.contains(HASHES[0]) and host.lru_order()[-1] == HASHES[0]
    assert store.get(HASHES[0]) == payload(0)
    assert store.stats.hits == [1, 1]
    store.flush(5)
    assert disk.contains(HASHES[2])  # promotion pushed block 2 out of host, down to disk


def test_miss_everywhere_is_none(store):
    assert store.get(HASHES[40]) is None and store.stats.misses == 1


def test_write_through_and_flush_persist(tmp_path):
    store = TieredStore([HostTier(1 << 20), DiskTier(tmp_path, 1 << 20, "m")])
    arrays = [np.full((4, 8), i, dtype=np.float16) for i in range(10)]
    for h, arr in zip(HASHES, arrays, strict=False):
        store.put(h, arr)
    assert store.close(5)
    reopened = DiskTier(tmp_path, 1 << 20, "m")  # as after a restart
    assert reopened.usage().blocks == 10
    for h, arr in zip(HASHES, arrays, strict=False):
        np.testing.assert_array_equal(reopened.load(h).to_numpy(), arr)


def test_restart_serves_from_disk(tmp_path):
    TieredStore([HostTier(1 << 20), DiskTier(tmp_path, 1 << 20, "m")]).close(5)
    first = TieredStore([HostTier(1 << 20), DiskTier(tmp_path, 1 << 20, "m")])
    first.put(HASHES[0], payload(9))
    first.close(5)
    second = TieredStore([HostTier(1 << 20), DiskTier(tmp_path, 1 << 20, "m")])
    assert second.get(HASHES[0]) == payload(9) and second.stats.hits == [0, 1]
    second.close(5)


def test_capacity_bounds_hold_on_both_tiers(tmp_path):
    disk_cap = 10 * (PREFIX_BYTES + 100)
    store = TieredStore([HostTier(500), DiskTier(tmp_path, disk_cap, "m")])
    for i in range(40):
        store.put(HASHES[i], payload(i))
        for usage in store.usage():
            assert usage.bytes_used <= usage.bytes_capacity
    assert store.close(5)
    host, disk = store.usage()
    assert host.blocks == 5 and disk.blocks == 10 and disk.bytes_used <= disk_cap


def test_full_queue_drops_instead_of_blocking(tmp_path):
    gate = threading.Event()

    class SlowDisk(DiskTier):
        def put(self, *args, **kwargs):
            gate.wait(5)
            return super().put(*args, **kwargs)

    store = TieredStore([HostTier(1 << 20), SlowDisk(tmp_path, 1 << 20, "m")], queue_size=2)
    for i in range(6):
        assert store.put(HASHES[i], payload(i))  # returns at once despite the stalled disk
    assert store.stats.dropped_writes >= 3
    assert store.get(HASHES[0]) == payload(0)
    gate.set()
    assert store.close(5)


def test_pending_block_is_readable_before_it_lands(tmp_path):
    gate = threading.Event()

    class SlowDisk(DiskTier):
        def put(self, *args, **kwargs):
            gate.wait(5)
            return super().put(*args, **kwargs)

    store = TieredStore([HostTier(100), SlowDisk(tmp_path, 1 << 20, "m")], write_through=False)
    store.put(HASHES[0], payload(0))
    store.put(HASHES[1], payload(1))  # evicts 0 from host; its demotion is stuck in the queue
    assert store.contains(HASHES[0])
    assert not store.flush(0.05)
    gate.set()
    assert store.close(5)
    assert store.tiers[1].contains(HASHES[0])


def test_concurrent_puts_and_gets_do_not_corrupt(tmp_path):
    store = TieredStore([HostTier(20 * 100), DiskTier(tmp_path, 1 << 20, "m", fsync=False)])
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(300):
            i = int(rng.integers(0, 60))
            if rng.random() < 0.5:
                store.put(HASHES[i], payload(i))
            else:
                data = store.get(HASHES[i])
                if data is not None and data != payload(i):
                    errors.append(f"block {i} corrupted")

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.close(10)
    assert errors == []
    host, disk = store.usage()
    assert host.bytes_used <= host.bytes_capacity
    for i in range(60):
        data = store.get(HASHES[i])
        assert data is None or data == payload(i)


def test_erase_removes_every_copy_and_a_queued_write_never_lands(tmp_path):
    host, disk = HostTier(1 << 20), DiskTier(tmp_path, 1 << 20, "m")
    s = TieredStore([host, disk], write_through=True)
    try:
        for i in range(3):
            s.put(HASHES[i], payload(i))
        assert s.flush(5)
        gate = threading.Event()
        real_put = disk.put

        def slow_put(*args, **kwargs):
            gate.wait(5)
            return real_put(*args, **kwargs)

        disk.put = slow_put  # the writer holds HASHES[3] while HASHES[4] waits in the queue
        s.put(HASHES[3], payload(3))
        s.put(HASHES[4], payload(4))
        threading.Timer(0.2, gate.set).start()
        erased = s.erase([HASHES[0], HASHES[3], HASHES[4], HASHES[9]])
        assert erased.per_tier[0] == 3 and erased.queued == 2
        assert erased.per_tier[1] in (1, 2)  # HASHES[3] if its write was under way
        assert s.flush(5)
        assert not any(s.contains(h) for h in (HASHES[0], HASHES[3], HASHES[4]))
        assert {p.name for p in tmp_path.rglob("*.kvb")} == {f"{h.hex()}.kvb" for h in HASHES[1:3]}
    finally:
        s.close(5)
