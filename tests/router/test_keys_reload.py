"""A keys file edited on disk takes effect without a restart, in the router and in a worker
reached directly: a new key is accepted, a removed key refused, a changed limit applied,
and a broken file leaves the keys in use."""

from __future__ import annotations

import json
import os
import secrets
import time

import httpx
import pytest
from procs import start_worker, stop_group, wait_healthy

from splitserve.common.keys_reload import KeysReload
from splitserve.common.kv_salts import KVSalts
from splitserve.common.tenants import Tenants
from splitserve.router.config import RouterConfig

from .conftest import RouterServer

pytestmark = pytest.mark.timeout(600)

SECRET = secrets.token_hex(16)


def write_keys(path, entries) -> None:
    """Replace the file as an editor or a secrets manager does: a new file renamed over."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entries))
    os.replace(tmp, path)


def test_a_changed_file_is_adopted_and_a_broken_one_is_not(tmp_path):
    path = tmp_path / "keys.json"
    write_keys(path, [{"key": "sk-a", "tenant": "alice"}])
    tenants = Tenants.load(path)
    reload = KeysReload(KVSalts(tenants, b"s"))
    assert not reload.poll()  # unchanged
    write_keys(path, [{"key": "sk-b", "tenant": "bob", "limits": {"requests_in_flight": 2}}])
    assert reload.poll()
    assert tenants.authenticate("Bearer sk-a") is None
    assert tenants.authenticate("Bearer sk-b").limits.requests_in_flight == 2
    path.write_text("[{")  # half written
    assert not reload.poll() and reload.failures == 1
    assert tenants.authenticate("Bearer sk-b") is not None
    write_keys(path, [{"key": "sk-b", "tenant": "bob"}, {"key": "sk-b", "tenant": "carol"}])
    assert not reload.poll() and reload.failures == 2  # a key listed twice: refused whole
    assert tenants.authenticate("Bearer sk-b").id == "bob"


def test_the_router_and_a_worker_take_a_new_key_and_drop_a_removed_one(tmp_path):
    path = tmp_path / "keys.json"
    write_keys(path, [{"key": "sk-alice", "tenant": "alice"}])
    url, proc = start_worker(["--max-model-len", "512", "--api-keys", str(path)], secret=SECRET)
    router = None
    try:
        wait_healthy(url, proc)
        config = RouterConfig.from_kwargs(
            workers=[url],
            api_keys_file=str(path),
            cluster_secret=SECRET.encode(),
            health_interval_s=0.2,
        )
        router = RouterServer(config)

        def status(base: str, key: str) -> int:
            body = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}
            headers = {"Authorization": f"Bearer {key}"}
            r = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=60)
            return r.status_code

        def until(check, what: str) -> None:
            deadline = time.monotonic() + 15
            while not check():
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                time.sleep(0.2)

        for base in (router.url, url):
            assert status(base, "sk-alice") == 200 and status(base, "sk-bob") == 401
        write_keys(path, [{"key": "sk-bob", "tenant": "bob"}])
        for base in (router.url, url):
            until(lambda b=base: status(b, "sk-bob") == 200, f"{base} to take bob's key")
            assert status(base, "sk-alice") == 401
        path.write_text("not json")
        time.sleep(2.5)  # two polls past the bad file
        for base in (router.url, url):
            assert status(base, "sk-bob") == 200
    finally:
        if router is not None:
            router.stop()
        stop_group(proc)
