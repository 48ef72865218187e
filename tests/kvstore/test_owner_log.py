from __future__ import annotations

from splitserve.common.kv_hash import hash_blocks, root_hash
from splitserve.kvstore import DiskTier
from splitserve.kvstore.owner_log import (
    COMPACT_MIN_BYTES,
    NO_SESSION,
    RECORD_BYTES,
    OwnerLog,
    session_digest,
)

H = hash_blocks(list(range(16 * 8)), root_hash("m"))


def test_records_by_tenant_and_session_and_drops(tmp_path):
    log = OwnerLog(tmp_path, fsync=False)
    log.append("t1", "s", H[:3])
    log.append("t1", None, H[3:4])
    log.append("t2", "s", H[4:5])
    assert log.records("t1") == [(session_digest("s"), h) for h in H[:3]] + [(NO_SESSION, H[3])]
    assert log.drop_session("t1", "s") == 3
    assert log.records("t1") == [(NO_SESSION, H[3])]
    assert log.records("t2") == [(session_digest("s"), H[4])]  # another tenant's session s
    assert log.drop_tenant("t1") and not log.drop_tenant("t1")
    assert log.records("t1") == []
    assert log.drop_session("t2", "s") == 1
    assert list((tmp_path / "owners").iterdir()) == []  # an empty log leaves no file


def test_a_torn_last_record_is_ignored(tmp_path):
    log = OwnerLog(tmp_path, fsync=False)
    log.append("t", "s", H[:2])
    (path,) = (tmp_path / "owners").iterdir()
    path.write_bytes(path.read_bytes() + b"half")
    assert len(log.records("t")) == 2


def test_compaction_drops_duplicates_and_blocks_no_tier_holds(tmp_path):
    log = OwnerLog(tmp_path, keep=lambda h: h != H[1], fsync=False)
    rounds = COMPACT_MIN_BYTES // (2 * RECORD_BYTES) + 1
    for _ in range(rounds):
        log.append("t", "s", H[:2])
    assert log.records("t") == [(session_digest("s"), H[0])]


def test_the_disk_tier_scan_leaves_the_owner_log_alone(tmp_path):
    log = OwnerLog(tmp_path, fsync=False)
    log.append("t", "s", H[:1])
    DiskTier(tmp_path, 1 << 20, "m")
    assert len(log.records("t")) == 1
