"""Tenants on real processes: keys files, the router's signed tenant, and KV isolation.

Alice and bob send the same prompt to the same worker. Alice's second send is a prefix-cache
hit; bob's never is: not in the device pool, not through the router, and not from the disk
tier after the worker restarts on alice's files.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from procs import free_port, start_worker, stop_group, wait_healthy

from splitserve.common.kv_hash import hash_blocks, root_hash
from splitserve.common.tenants import TENANT_HEADER, kv_salt, sign

SECRET = secrets.token_hex(16)
KEYS = {"alice": "sk-alice-1", "alice2": "sk-alice-2", "bob": "sk-bob"}
POOL = ["--kv-cache-gb", "0.015"]  # 21 blocks of 16 tokens
BS = 16
PROMPT = [(7 * i) % 5000 + 100 for i in range(100)]  # 6 full blocks
FILLER = [(11 * i) % 5000 + 200 for i in range(320)]  # needs the whole pool


def auth(who: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[who]}"}


def cached(url: str, who: str, prompt: list[int] = PROMPT, **extra) -> int:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=auth(who), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    root = tmp_path_factory.mktemp("tenants")
    keys = root / "keys.json"
    entries = [
        {"key": KEYS["alice"], "tenant": "alice"},
        {"key": KEYS["alice2"], "tenant": "alice"},
        {"key": KEYS["bob"], "tenant": "bob"},
    ]
    keys.write_text(json.dumps(entries))
    disk = root / "disk"
    args = [*POOL, "--disk-kv-dir", str(disk), "--disk-kv-gb", "0.05", "--api-keys", str(keys)]
    worker = Restartable(args)
    router_url, router = start_router(worker.url, keys)
    worker.watchers.append((router_url, router))
    try:
        yield worker, router_url, disk
    finally:
        stop_group(router)
        worker.stop()


class Restartable:
    def __init__(self, args: list[str]) -> None:
        self.args = args
        self.url, self.proc = start_worker(args, secret=SECRET)
        wait_healthy(self.url, self.proc)
        # Routers that probe this worker: after a restart, until one probe finds it up again,
        # a router still holds it down (503) for up to a probe interval and a timeout.
        self.watchers: list[tuple[str, subprocess.Popen]] = []

    def restart(self) -> None:
        self.stop()
        port = self.url.rsplit(":", 1)[1]
        argv = [sys.executable, "-m", "splitserve.cli", "worker", "--host", "127.0.0.1"]
        argv += ["--port", port, "--threads", "1", "--log-level", "warning", *self.args]
        env = {**os.environ, "SPLITSERVE_KV_SECRET": SECRET}
        self.proc = subprocess.Popen(argv, env=env, start_new_session=True)
        wait_healthy(self.url, self.proc)
        for url, proc in self.watchers:
            wait_healthy(url, proc, timeout=60)

    def stop(self) -> None:
        stop_group(self.proc)


def start_router(worker_url: str, keys: Path) -> tuple[str, subprocess.Popen]:
    port = free_port()
    argv = [sys.executable, "-m", "splitserve.cli", "router", "--port", str(port)]
    argv += ["--workers", worker_url, "--api-keys", str(keys), "--log-level", "warning"]
    env = {**os.environ, "SPLITSERVE_KV_SECRET": SECRET}
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, timeout=60)
    return url, proc


def test_tenants_never_share_a_cached_block(deployment):
    worker, router, _ = deployment
    full = len(PROMPT) // BS * BS  # every full block (the prompt ends mid-block)
    assert cached(worker.url, "alice") == 0
    assert cached(worker.url, "alice") == full
    assert cached(worker.url, "alice2") == full  # another key of the same tenant
    assert cached(worker.url, "bob") == 0
    # Through the router, which tells the worker the tenant in a signed header.
    other = PROMPT[::-1]
    assert cached(router, "alice", other) == 0
    assert cached(router, "alice", other) == full
    assert cached(router, "bob", other) == 0
    assert cached(worker.url, "bob", other) == full  # the same salt as bob's own key gives
    # A cache_salt splits one tenant's cache too (vLLM's field).
    assert cached(worker.url, "alice", cache_salt="user-1") == 0
    assert cached(router, "alice", cache_salt="user-1") == full


def test_after_a_restart_no_tenant_finds_anothers_disk_blocks(deployment):
    worker, _, disk = deployment
    prompt = [(13 * i) % 5000 + 300 for i in range(100)]
    assert cached(worker.url, "alice", prompt) == 0
    cached(worker.url, "alice", FILLER)  # evicts alice's blocks down to disk
    worker.restart()
    alice = hash_blocks(prompt, root_hash(_model_id(worker.url), kv_salt(SECRET.encode(), "alice")))
    bob = hash_blocks(prompt, root_hash(_model_id(worker.url), kv_salt(SECRET.encode(), "bob")))
    on_disk = _files(disk)
    assert alice[0].hex() in on_disk and not any(h.hex() in on_disk for h in bob)
    assert cached(worker.url, "bob", prompt) == 0
    assert cached(worker.url, "alice", prompt) > 0  # alice's own KV came back from disk


def test_workers_trust_only_signed_tenants_and_router_fields(deployment):
    worker, router, _ = deployment
    body = json.dumps({"prompt": PROMPT[:20], "max_tokens": 1, "temperature": 0}).encode()
    path = "/v1/completions"
    forged = sign(b"wrong-secret", "POST", path, "alice", body)
    r = httpx.post(f"{worker.url}{path}", content=body, headers={TENANT_HEADER: forged})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_signature"
    genuine = sign(SECRET.encode(), "POST", path, "alice", body)
    r = httpx.post(f"{worker.url}{path}", content=body, headers={TENANT_HEADER: genuine})
    assert r.status_code == 200
    other = json.dumps({"prompt": PROMPT[:21], "max_tokens": 1}).encode()  # replayed elsewhere
    r = httpx.post(f"{worker.url}{path}", content=other, headers={TENANT_HEADER: genuine})
    assert r.status_code == 401
    # A client-written kv_peer: refused by the worker, dropped (never signed) by the router.
    hinted = {"prompt": PROMPT[:20], "max_tokens": 1, "kv_peer": "http://10.255.255.1:9"}
    r = httpx.post(f"{worker.url}{path}", json=hinted, headers=auth("alice"), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_peer"
    r = httpx.post(f"{router}{path}", json=hinted, headers=auth("alice"), timeout=30)
    assert r.status_code == 200
    r = httpx.post(f"{router}{path}", json=hinted, headers={"authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def _model_id(url: str) -> str:
    r = httpx.get(f"{url}/v1/models", headers=auth("alice"), timeout=10)
    return r.json()["data"][0]["id"]


def _files(root: Path) -> str:
    return " ".join(p.name for p in root.rglob("*") if p.is_file())
