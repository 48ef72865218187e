"""Tenants: the keys file, constant-time key lookup, the router's signature, the KV salt."""

from __future__ import annotations

import hashlib
import json

import pytest

from splitserve.common import tenants as t
from splitserve.common.tenants import (
    DEFAULT_TENANT,
    InvalidSignature,
    Limits,
    Tenants,
    kv_salt,
    sign,
    verify,
)

SECRET = b"cluster-secret"


def keys_file(tmp_path, entries) -> str:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(entries))
    return str(path)


def test_keys_file_maps_each_key_to_its_tenant(tmp_path):
    bob_hash = hashlib.sha256(b"sk-bob").hexdigest()
    tenants = Tenants.load(
        keys_file(
            tmp_path,
            [
                {"key": "sk-alice-1", "tenant": "alice"},
                {"key": "sk-alice-2", "tenant": "alice"},
                {"key_sha256": bob_hash, "tenant": "bob", "limits": {"requests_in_flight": 2}},
            ],
        )
    )
    assert tenants.required
    assert tenants.authenticate("Bearer sk-alice-1").id == "alice"
    assert tenants.authenticate("Bearer sk-alice-2").id == "alice"
    bob = tenants.authenticate("bearer sk-bob")
    assert bob.id == "bob" and bob.limits == Limits(requests_in_flight=2)
    for header in ("", "Bearer", "Bearer sk-carol", "Basic sk-bob", "sk-bob"):
        assert tenants.authenticate(header) is None, header


def test_no_keys_means_everyone_is_the_default_tenant():
    assert not Tenants.open().required
    assert Tenants.open().authenticate("").id == DEFAULT_TENANT
    single = Tenants.single("k")
    assert single.authenticate("Bearer k").id == DEFAULT_TENANT
    assert single.authenticate("Bearer x") is None


@pytest.mark.parametrize(
    "entries, message",
    [
        ({"key": "k", "tenant": "a"}, "non-empty JSON list"),
        ([], "non-empty JSON list"),
        (["k"], "must be an object"),
        ([{"key": "k"}], "tenant must be"),
        ([{"key": "k", "tenant": "a b"}], "tenant must be"),
        ([{"key": "k", "tenant": "x" * 65}], "tenant must be"),
        ([{"tenant": "a"}], "exactly one of key and key_sha256"),
        ([{"key": "k", "key_sha256": "00" * 32, "tenant": "a"}], "exactly one"),
        ([{"key_sha256": "zz", "tenant": "a"}], "64 hex digits"),
        ([{"key": "", "tenant": "a"}], "non-empty string"),
        ([{"key": "k", "tenant": "a", "role": "admin"}], "unknown field"),
        ([{"key": "k", "tenant": "a", "limits": {"rpm": 1}}], "unknown limit"),
        ([{"key": "k", "tenant": "a", "limits": {"kv_blocks": 0}}], "positive integer"),
        ([{"key": "k", "tenant": "a"}, {"key": "k", "tenant": "b"}], "listed twice"),
        (
            [
                {"key": "k1", "tenant": "a", "limits": {"kv_blocks": 1}},
                {"key": "k2", "tenant": "a", "limits": {"kv_blocks": 2}},
            ],
            "two different limits",
        ),
    ],
)
def test_bad_keys_files_are_clear_errors(tmp_path, entries, message):
    with pytest.raises(ValueError, match=message):
        Tenants.load(keys_file(tmp_path, entries))


def test_unreadable_or_invalid_keys_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        Tenants.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("[{")
    with pytest.raises(ValueError, match="not valid JSON"):
        Tenants.load(bad)


def test_errors_never_show_a_key(tmp_path):
    with pytest.raises(ValueError) as e:
        Tenants.load(keys_file(tmp_path, [{"key": "sk-secret-1", "tenant": "a b"}]))
    assert "sk-secret-1" not in str(e.value)


def test_signature_round_trip_and_what_it_covers():
    body = b'{"prompt": "hi", "kv_peer": "http://10.0.0.1:9"}'
    value = sign(SECRET, "POST", "/v1/completions", "alice", body)
    assert verify(SECRET, value, "POST", "/v1/completions", body) == "alice"
    tampered = [
        (b"cluster-secreT", value, "POST", "/v1/completions", body),
        (SECRET, value, "POST", "/v1/chat/completions", body),
        (SECRET, value, "GET", "/v1/completions", body),
        (SECRET, value, "POST", "/v1/completions", body.replace(b"10.0.0.1", b"10.0.0.2")),
        (SECRET, value.replace("alice", "bobby"), "POST", "/v1/completions", body),
    ]
    for args in tampered:
        with pytest.raises(InvalidSignature, match="forged"):
            verify(*args)
    for bad in ("", "v1", "v2 1 alice ab", "v1 x alice ab", "v1 1 a|b ab"):
        with pytest.raises(InvalidSignature, match="malformed"):
            verify(SECRET, bad, "POST", "/v1/completions", body)


def test_a_stale_signature_is_refused(monkeypatch):
    value = sign(SECRET, "GET", "/load", DEFAULT_TENANT, None)
    now = t.time.time()
    monkeypatch.setattr(t.time, "time", lambda: now + t.MAX_SKEW_S + 5)
    with pytest.raises(InvalidSignature, match="stale"):
        verify(SECRET, value, "GET", "/load", None)


def test_kv_salt_separates_tenants_and_cache_salts():
    assert kv_salt(SECRET, DEFAULT_TENANT) == ""  # the default tenant keeps today's hashes
    alice, bob = kv_salt(SECRET, "alice"), kv_salt(SECRET, "bob")
    assert alice and bob and alice != bob
    assert kv_salt(SECRET, "alice") == alice  # stable: the disk tier outlives a restart
    assert kv_salt(b"other-secret", "alice") != alice  # unguessable without the secret
    assert kv_salt(SECRET, "alice", "user-7") not in ("", alice, kv_salt(SECRET, "bob", "user-7"))
    assert kv_salt(SECRET, DEFAULT_TENANT, "user-7") not in ("", kv_salt(SECRET, "alice"))
