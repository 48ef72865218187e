"""Public prefixes: the keys file that declares them, the principals of separated keys, and
the salt a request gets (``common/kv_salts.py``)."""

from __future__ import annotations

import json

import pytest

from splitserve.common.kv_hash import hash_blocks, root_hash, split_salt
from splitserve.common.kv_salts import KVSalts
from splitserve.common.public_prefix import PublicPrefix, shared_tokens
from splitserve.common.tenants import Tenants, kv_salt, public_salt, sign, verify

SECRET = b"cluster-secret"
SYSTEM = "You are Acme's assistant."
KEYS = {
    "keys": [
        {"key": "sk-acme-1", "tenant": "acme", "share_public_prefix": True},
        {"key": "sk-acme-2", "tenant": "acme", "share_public_prefix": True},
        {"key": "sk-acme-3", "tenant": "acme"},
        {"key": "sk-bob", "tenant": "bob"},
        {"key": "sk-bob-2", "tenant": "bob"},
    ],
    "tenants": {
        "acme": {"public_prefixes": [SYSTEM, {"messages": [{"role": "system", "content": SYSTEM}]}]}
    },
}


def load(tmp_path, raw) -> Tenants:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(raw))
    return Tenants.load(path)


def text_ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def chat_ids(messages) -> list[int]:
    return text_ids("".join(f"<{m['role']}>{m['content']}</>" for m in messages) + "<a>")


def test_a_tenant_with_public_prefixes_separates_its_keys(tmp_path):
    tenants = load(tmp_path, KEYS)
    one, two, three = (tenants.identify(f"Bearer sk-acme-{i}") for i in (1, 2, 3))
    assert {k.tenant.id for k in (one, two, three)} == {"acme"}
    assert len({one.principal, two.principal, three.principal}) == 3
    assert all(k.principal.startswith("acme/") for k in (one, two, three))
    assert (one.shares_prefix, two.shares_prefix, three.shares_prefix) == (True, True, False)
    assert tenants.by_id["acme"].public_prefixes == (
        PublicPrefix(text=SYSTEM),
        PublicPrefix(messages=(("system", SYSTEM),)),
    )
    bob, bob2 = tenants.identify("Bearer sk-bob"), tenants.identify("Bearer sk-bob-2")
    assert bob.principal == bob2.principal == "bob"  # no declaration: one principal
    assert tenants.authenticate("Bearer sk-acme-1").id == "acme"
    again = load(tmp_path, KEYS).identify("Bearer sk-acme-1")
    assert again.principal == one.principal  # from the key's hash: every process agrees


def test_the_signature_carries_a_principal(tmp_path):
    principal = load(tmp_path, KEYS).identify("Bearer sk-acme-1").principal
    value = sign(SECRET, "POST", "/v1/completions", principal, b"{}")
    assert verify(SECRET, value, "POST", "/v1/completions", b"{}") == principal


def test_salts_share_the_public_prefix_among_keys_that_opt_in_only(tmp_path):
    tenants = load(tmp_path, KEYS)
    salts = KVSalts(tenants, SECRET, text_ids, chat_ids)
    p1, p2, p3 = (tenants.identify(f"Bearer sk-acme-{i}").principal for i in (1, 2, 3))
    prompt = text_ids(SYSTEM + " What is 2 + 2?")
    public = public_salt(SECRET, "acme")
    n = len(SYSTEM)
    assert salts.salt(p1, None, prompt) == split_salt(public, n, kv_salt(SECRET, p1))
    assert salts.salt(p2, None, prompt) == split_salt(public, n, kv_salt(SECRET, p2))
    assert salts.salt(p3, None, prompt) == kv_salt(SECRET, p3)  # did not opt in
    assert salts.salt("bob", None, prompt) == kv_salt(SECRET, "bob")
    assert salts.salt(p1, "mine", prompt) == kv_salt(SECRET, p1, "mine")  # asked for its own
    assert salts.salt(p1, None, text_ids("Hello")) == kv_salt(SECRET, p1)
    assert salts.salt(p1, None, None) == kv_salt(SECRET, p1)
    chat = chat_ids([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}])
    assert salts.salt(p1, None, chat) == split_salt(
        public, len("<system>" + SYSTEM + "</><"), kv_salt(SECRET, p1)
    )
    # The hashes: equal blocks within the prefix, none after it, none with another key.
    h1, h2, h3 = (
        hash_blocks(prompt, root_hash("m", salts.salt(p, None, prompt)), 8) for p in (p1, p2, p3)
    )
    within = n // 8
    assert h1[:within] == h2[:within] and h1[within:] != h2[within:]
    assert not set(h3) & (set(h1) | set(h2))


def test_without_a_tokenizer_nothing_is_shared(tmp_path):
    tenants = load(tmp_path, KEYS)
    p1 = tenants.identify("Bearer sk-acme-1").principal
    assert KVSalts(tenants, SECRET).salt(p1, None, text_ids(SYSTEM)) == kv_salt(SECRET, p1)


def test_a_prefix_the_tokenizer_refuses_is_an_error_at_start(tmp_path):
    def refuse(messages):
        raise ValueError("roles must alternate")

    with pytest.raises(ValueError, match="tenant 'acme': public prefix 1 cannot be tokenized"):
        KVSalts(load(tmp_path, KEYS), SECRET, text_ids, refuse)


def test_shared_tokens_is_the_longest_agreement():
    assert shared_tokens([1, 2, 3, 4], [[1, 2, 9], [1, 2, 3], [7]]) == 3
    assert shared_tokens([1, 2], [[1, 2, 3, 4]]) == 2
    assert shared_tokens([5], [[1]]) == 0


def keys_with(**changes):
    raw = json.loads(json.dumps(KEYS))
    for path, value in changes.items():
        where = raw
        *parents, last = path.split("__")
        for p in parents:
            where = where[int(p)] if p.isdigit() else where[p]
        where[last] = value
    return raw


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"keys": []}, "non-empty JSON list"),
        ({**KEYS, "extra": 1}, "unknown field"),
        (keys_with(tenants=[]), "tenants must be an object"),
        (keys_with(tenants={"a b": {"public_prefixes": ["x"]}}), "tenant id must be"),
        (keys_with(tenants={"acme": {"public_prefixes": ["x"], "x": 1}}), "public_prefixes"),
        (keys_with(tenants__acme__public_prefixes=[]), "non-empty list"),
        (keys_with(tenants__acme__public_prefixes="x"), "non-empty list"),
        (keys_with(tenants__acme__public_prefixes=[""]), "public prefix 0 is an empty text"),
        (keys_with(tenants__acme__public_prefixes=[3]), 'a text or {"messages"'),
        (keys_with(tenants__acme__public_prefixes=[{"messages": []}]), "non-empty list"),
        (
            keys_with(tenants__acme__public_prefixes=[{"messages": [{"role": "tool"}]}]),
            "exactly role and content",
        ),
        (
            keys_with(
                tenants__acme__public_prefixes=[{"messages": [{"role": "bot", "content": "x"}]}]
            ),
            "role must be one of",
        ),
        (
            keys_with(
                tenants__acme__public_prefixes=[{"messages": [{"role": "user", "content": ""}]}]
            ),
            "content must be a non-empty string",
        ),
        (keys_with(keys__0__share_public_prefix="yes"), "must be true or false"),
        (keys_with(keys__3__share_public_prefix=True), "needs public_prefixes declared"),
        (keys_with(tenants={**KEYS["tenants"], "carol": KEYS["tenants"]["acme"]}), "no key"),
    ],
)
def test_bad_declarations_are_clear_errors(tmp_path, raw, message):
    with pytest.raises(ValueError, match=message):
        load(tmp_path, raw)
