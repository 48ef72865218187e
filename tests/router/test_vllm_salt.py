"""vLLM workers know no tenants: the router hands them each tenant's KV salt as vLLM's own
``cache_salt``, so two tenants never share vLLM's prefix cache (fake worker processes record
what they received; tests/cluster/test_vllm_serve.py shows it on real vLLM)."""

from __future__ import annotations

import json

import pytest

from splitserve.common.tenants import kv_salt

from .test_proxy import chat, post, urls

pytestmark = pytest.mark.timeout(120)

SECRET = b"s" * 32


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys.json"
    keys = [
        {"key": "sk-a", "tenant": "alice"},
        {"key": "sk-b", "tenant": "bob"},
        {"key": "sk-d", "tenant": "default"},
    ]
    path.write_text(json.dumps(keys))
    return str(path)


def _sent_salt(worker, router, key: str, **fields) -> str | None:
    r = post(router, chat("s1", **fields), {"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return worker.seen()[-1]["body"].get("cache_salt")


def test_each_tenant_reaches_vllm_with_its_own_salt(workers3, make_router, keys_file):
    worker = workers3[0]
    router = make_router(
        workers=urls([worker]),
        api_keys_file=keys_file,
        cluster_secret=SECRET,
        worker_engine="vllm",
    )
    alice, bob = _sent_salt(worker, router, "sk-a"), _sent_salt(worker, router, "sk-b")
    assert alice == kv_salt(SECRET, "alice") and bob == kv_salt(SECRET, "bob")
    assert alice != bob
    # The client's own cache_salt is folded in, never taken as it is.
    own = _sent_salt(worker, router, "sk-a", cache_salt="team-1")
    assert own == kv_salt(SECRET, "alice", "team-1") != "team-1"
    # A client of another tenant naming alice's salt gets a salt of its own.
    assert _sent_salt(worker, router, "sk-b", cache_salt=alice) != alice
    # The default tenant without a cache_salt shares vLLM's cache as it always did.
    assert _sent_salt(worker, router, "sk-d") is None


def test_builtin_workers_get_the_clients_body(workers3, make_router, keys_file):
    # Builtin workers derive the salt themselves from the signed tenant.
    worker = workers3[0]
    router = make_router(workers=urls([worker]), api_keys_file=keys_file, cluster_secret=SECRET)
    assert _sent_salt(worker, router, "sk-a") is None
    assert _sent_salt(worker, router, "sk-a", cache_salt="team-1") == "team-1"


def test_worker_engine_is_validated(make_router):
    with pytest.raises(ValueError, match="worker_engine"):
        make_router(workers=["http://127.0.0.1:9"], worker_engine="sglang")
