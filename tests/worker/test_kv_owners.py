"""The owner record: what each (tenant, session) made, what an erasure takes and keeps."""

from __future__ import annotations

from splitserve.common.kv_hash import hash_blocks, root_hash
from splitserve.kvstore.owner_log import OwnerLog
from splitserve.worker.kv_owners import KVOwners


def hasher(ids: list[int], salt: str) -> list[bytes]:
    return hash_blocks(ids, root_hash("m", salt), 4)


def test_sessions_are_namespaced_by_tenant_and_shared_blocks_are_kept():
    owners = KVOwners(hasher)
    prefix = [1, 2, 3, 4, 5, 6, 7, 8]
    a = owners.begin("A", "s", "r1", "", prefix + [9, 9, 9, 9])
    owners.end(a, "", prefix + [9, 9, 9, 9, 10, 10, 10, 10, 11])
    b = owners.begin("A", "other", "r2", "", prefix + [8, 8, 8, 8])
    owners.end(b, "", prefix + [8, 8, 8, 8])
    owners.end(owners.begin("B", "s", "r3", "b-salt", [1, 2, 3, 4]), "b-salt", [1, 2, 3, 4])
    claim = owners.claim_session("A", "s")
    assert claim.shared == set(hasher(prefix, ""))  # the other session of A made them too
    assert claim.erase == set(hasher(prefix + [9] * 4 + [10] * 4, "")[2:])
    owners.forget_session("A", "s")
    assert owners.claim_session("A", "s") == (set(), set())
    assert owners.claim_session("B", "s").erase == set(hasher([1, 2, 3, 4], "b-salt"))


def test_a_finished_request_without_a_session_keeps_nothing_but_a_running_one_does():
    owners = KVOwners(hasher)
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    owners.end(owners.begin("A", "s", "r1", "", ids), "", ids)
    running = owners.begin("A", None, "r2", "", ids)
    assert owners.claim_session("A", "s").shared == set(hasher(ids, ""))
    owners.end(running, "", ids)
    assert owners.claim_session("A", "s").shared == set()
    assert owners.claim_tenant("A").erase == set(hasher(ids, ""))
    owners.forget_tenant("A")
    assert owners.claim_tenant("A").erase == set()


def test_the_record_is_bounded_and_the_owner_log_remembers_what_it_forgets(tmp_path):
    owners = KVOwners(hasher, OwnerLog(tmp_path, fsync=False), max_blocks=8)
    for s in range(6):  # 2 blocks each: the oldest sessions are forgotten in memory
        ids = [s * 100 + i for i in range(8)]
        owners.end(owners.begin("A", f"s{s}", f"r{s}", "", ids), "", ids)
    assert sum(len(o.hashes) for o in owners._owners.values()) <= 8
    assert ("A", True, "s0") not in owners._owners
    assert owners.claim_session("A", "s0").erase == set(hasher(list(range(8)), ""))
    restarted = KVOwners(hasher, OwnerLog(tmp_path, fsync=False))
    assert len(restarted.claim_tenant("A").erase) == 12
