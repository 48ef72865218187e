"""Stored responses on disk (``worker/saved_responses.py``): what survives a restart, the
bounds, sealing, and deletion. No model: records are made up."""

from __future__ import annotations

import pytest

from splitserve.kvstore.keyring import KeyRing
from splitserve.worker.response_store import ResponseStore, StoredResponse
from splitserve.worker.saved_responses import RESPONSES_DIR, SavedResponses

KEY, OTHER_KEY = bytes(range(32)), bytes(range(1, 33))


def record(n: int, words: int = 1) -> StoredResponse:
    context = ({"role": "user", "content": "é " * words}, {"role": "assistant", "content": "ok"})
    return StoredResponse(f"resp_{n}", "chain", {"id": f"resp_{n}", "n": n}, context)


def store(directory, per_tenant: int = 4, **kw) -> ResponseStore:
    return ResponseStore(per_tenant, SavedResponses(directory, per_tenant, fsync=False, **kw))


@pytest.mark.parametrize("key", [None, KEY], ids=["plain", "sealed"])
def test_a_stored_response_survives_a_restart(tmp_path, key):
    ring = None if key is None else KeyRing.of(key)
    before = store(tmp_path, ring=ring)
    before.put("A", record(1))
    after = store(tmp_path, ring=ring)
    assert after.get("A", "resp_1") == record(1)
    assert after.get("B", "resp_1") is None  # tenants never see each other's
    [raw] = [p.read_bytes() for p in (tmp_path / RESPONSES_DIR).rglob("*") if p.is_file()]
    assert (b"assistant" in raw) is (key is None)  # sealed: no plaintext on disk


def test_a_row_that_cannot_be_opened_is_forgotten(tmp_path):
    sealed = store(tmp_path, ring=KeyRing.of(KEY))
    sealed.put("A", record(1))
    other = store(tmp_path, ring=KeyRing.of(OTHER_KEY))  # the key was dropped from the file
    assert other.get("A", "resp_1") is None
    assert len(SavedResponses(tmp_path, 4)) == 0


def test_the_least_recently_used_go_past_the_tenants_bound_on_disk_too(tmp_path):
    first = store(tmp_path, per_tenant=2)
    first.put("A", record(1))
    first.put("A", record(2))
    first.get("A", "resp_1")  # now 2 is the least recently used
    first.put("A", record(3))
    first.put("B", record(9))
    after = store(tmp_path, per_tenant=2)
    assert [after.get("A", f"resp_{n}") is not None for n in (1, 2, 3)] == [True, False, True]
    assert after.get("B", "resp_9") is not None


def test_the_file_is_bounded_in_bytes(tmp_path):
    saved = SavedResponses(tmp_path, 100, max_bytes=3000, fsync=False)
    for n in range(10):
        saved.save("A", record(n, words=300).as_dict())  # about 700 bytes each
    kept = [n for n in range(10) if saved.load("A", f"resp_{n}") is not None]
    assert kept == list(range(10 - len(kept), 10)) and 2 <= len(kept) <= 4


def test_deleting_a_response_or_erasing_its_tenant_deletes_it_on_disk(tmp_path):
    s = store(tmp_path)
    for n in (1, 2):
        s.put("A", record(n))
    s.put("B", record(3))
    assert s.delete("A", "resp_1") and not s.delete("A", "resp_1")
    assert s.forget_tenant("A") == 1
    after = store(tmp_path)
    assert after.get("A", "resp_2") is None and after.get("B", "resp_3") is not None
    assert len(list((tmp_path / RESPONSES_DIR).iterdir())) == 1  # A's directory is gone


def test_kv_reencrypt_reseals_stored_responses_so_the_old_key_can_go(tmp_path, capsys):
    import os

    from splitserve.cli import main
    from splitserve.kvstore import load_keyring

    key_file = tmp_path / "kv.key"
    key_file.write_bytes(os.urandom(32))
    os.chmod(key_file, 0o600)
    disk = tmp_path / "disk"
    store(disk, ring=load_keyring(key_file)).put("A", record(1))
    assert main(["kv", "rotate", str(key_file)]) == 0
    old = [k for k in load_keyring(key_file).keys if k != load_keyring(key_file).current][0]
    store(disk, ring=load_keyring(key_file)).put("A", record(2))  # under the new key
    capsys.readouterr()
    assert main(["kv", "reencrypt", str(disk), "--kv-encryption-key-file", str(key_file)]) == 0
    assert "1 stored responses re-sealed, 1 already were" in capsys.readouterr().out
    assert main(["kv", "drop-key", str(key_file), old.hex()]) == 0
    after = store(disk, ring=load_keyring(key_file))
    assert after.get("A", "resp_1") == record(1) and after.get("A", "resp_2") == record(2)


def test_a_response_sealed_by_the_previous_format_still_opens(tmp_path):
    # Sealed with the response id, not the file name, as associated data.
    import json

    from splitserve.kvstore.keyring import new_nonce
    from splitserve.kvstore.owner_log import tenant_digest
    from splitserve.worker import saved_responses as saved

    ring = KeyRing.of(KEY)
    store(tmp_path, ring=ring).put("A", record(1))
    [path] = [p for p in (tmp_path / RESPONSES_DIR).rglob("*") if p.is_file()]
    plain = json.dumps(store(tmp_path, ring=ring).saved.load("A", "resp_1")).encode()
    nonce, owner = new_nonce(), tenant_digest("A")
    body = ring.seal(nonce, plain, saved._legacy_aad(owner, "resp_1"))
    path.write_bytes(saved.SEALED + ring.current + nonce + body)
    assert store(tmp_path, ring=ring).get("A", "resp_1") == record(1)
