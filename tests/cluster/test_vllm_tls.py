"""``splitserve serve --engine vllm --tls``: the router and a real vLLM worker both serve
HTTPS with the run's private CA, and the router verifies the worker by it. Skipped without
``.venv-vllm``."""

from __future__ import annotations

import os
import queue
import sys
import time

import httpx
import pytest
from procs import free_port, skip_without_vllm, start_launcher, stop_group

from splitserve.common.tls import client_context

skip_without_vllm()

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
ADMIN = "tls-admin-key"


def test_router_and_vllm_worker_serve_https_verified_by_the_runs_ca():
    import openai

    port = free_port()
    argv = [sys.executable, "-m", "splitserve.cli", "serve", "--engine", "vllm", "--tls"]
    argv += ["--port", str(port), "--decode", "1", "--threads-per-worker", "1"]
    argv += ["--dtype", "float32", "--kv-cache-gb", "0.25", "--max-model-len", "1024"]
    argv += ["--ready-timeout", "600"]
    launcher, lines = start_launcher(argv, {**os.environ, "SPLITSERVE_ADMIN_KEY": ADMIN})
    try:
        ca, deadline = None, time.monotonic() + 660
        while ca is None:
            assert launcher.poll() is None, f"serve exited with code {launcher.returncode}"
            assert time.monotonic() < deadline, "serve did not say where its CA is"
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if "SSL_CERT_FILE=" in line:
                ca = line.split("SSL_CERT_FILE=")[1].split()[0]
        url = f"https://127.0.0.1:{port}"
        verify = client_context(ca)
        http = httpx.Client(verify=verify, timeout=120)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", http_client=http)
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=8,
            temperature=0,
        )
        assert "Paris" in reply.choices[0].message.content
        auth = {"Authorization": f"Bearer {ADMIN}"}
        (worker,) = http.get(f"{url}/workers", headers=auth).json()["workers"]
        assert worker["url"].startswith("https://") and worker["healthy"]
        assert http.get(f"{worker['url']}/health").status_code == 200  # vLLM itself, by the CA
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served
            httpx.get(worker["url"].replace("https://", "http://") + "/health", timeout=10)
    finally:
        stop_group(launcher, timeout=60)
