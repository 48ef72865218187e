"""TLS on every HTTP leg: client -> router -> worker, and worker -> worker (peer KV fetch).

Certificates come from ``trustme``; every process binds 127.0.0.1 on a free port. The
real-model part (two ``splitserve worker`` processes and a ``splitserve router`` process, all
serving HTTPS) starts once for the module; the rest runs against fake workers serving HTTPS.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple

import httpx
import openai
import pytest
import trustme
from procs import die_with_parent, free_port, metric, start_worker, stop_group, wait_healthy

from splitserve.bench.client import Endpoint
from splitserve.bench.load import run_load
from splitserve.common.tenants import DEFAULT_TENANT, TENANT_HEADER, sign
from splitserve.router.proxy import DECODE_HEADER
from splitserve.workload.runs import Load
from splitserve.workload.sessions import RandomConfig

from .conftest import HTTP, FakeWorker, wait_until

pytestmark = pytest.mark.timeout(600)  # a loaded machine: two model workers start in the first

SECRET = "tls-test-secret"


class Pki(NamedTuple):
    ca: str  # the CA that issued the servers' certificate
    cert: str  # the servers' certificate (127.0.0.1, localhost)
    key: str
    other_ca: str  # a CA that issued nothing here
    verify: ssl.SSLContext  # a client context trusting ``ca``

    @property
    def server(self) -> tuple[str, str]:
        return self.cert, self.key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    root = tmp_path_factory.mktemp("tls")
    ca, other = trustme.CA(), trustme.CA()
    issued = ca.issue_cert("127.0.0.1", "localhost")
    files = Pki(*(str(root / n) for n in ("ca.pem", "server.pem", "server.key", "other.pem")), None)
    ca.cert_pem.write_to_path(files.ca)
    for blob in issued.cert_chain_pems:
        blob.write_to_path(files.cert, append=True)
    issued.private_key_pem.write_to_path(files.key)
    other.cert_pem.write_to_path(files.other_ca)
    return files._replace(verify=ssl.create_default_context(cafile=files.ca))


def tls_client(pki: Pki) -> httpx.Client:
    return httpx.Client(verify=pki.verify, timeout=60.0)


def start_router(pki: Pki, workers: list[str], *extra: str) -> tuple[str, subprocess.Popen]:
    """``splitserve router`` serving HTTPS in front of ``workers``, verified by ``pki.ca``."""
    port = free_port()
    argv = [sys.executable, "-m", "splitserve.cli", "router", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--workers", *workers, "--health-interval", "0.2"]
    argv += ["--ssl-certfile", pki.cert, "--ssl-keyfile", pki.key, "--worker-ca", pki.ca]
    argv += ["--log-level", "warning", *extra]
    proc = subprocess.Popen(
        argv, stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=die_with_parent
    )
    return f"https://127.0.0.1:{port}", proc


# ---- real workers: the official client, peer KV fetch --------------------------------------


class Deployment(NamedTuple):
    router: str
    workers: list[str]
    router_proc: subprocess.Popen


@pytest.fixture(scope="module")
def deployment(pki: Pki) -> Iterator[Deployment]:
    """Two HTTPS model workers lending each other KV (``--kv-peer``) behind an HTTPS router."""
    args = ["--kv-peer", "--kv-cache-gb", "0.1", "--max-model-len", "512", "--worker-ca", pki.ca]
    procs = [start_worker(args, secret=SECRET, tls=pki.server) for _ in range(2)]
    urls = [url for url, _ in procs]
    router = None
    try:
        for url, proc in procs:
            wait_healthy(url, proc, timeout=240, verify=pki.verify)
        router, router_proc = start_router(pki, urls)
        wait_healthy(router, router_proc, timeout=60, verify=pki.verify)
        yield Deployment(router, urls, router_proc)
    finally:
        if router is not None:
            stop_group(router_proc)
        for _, proc in procs:
            stop_group(proc)
    if router is not None:
        log = router_proc.stderr.read()
        assert "Traceback" not in log, log


def test_the_openai_client_reaches_a_tls_worker_through_the_tls_router(pki, deployment):
    with tls_client(pki) as http:
        client = openai.OpenAI(base_url=f"{deployment.router}/v1", api_key="x", http_client=http)
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "Name three colours."}]
        reply = client.chat.completions.create(
            model=model, messages=messages, max_tokens=8, temperature=0
        )
        text = reply.choices[0].message.content
        assert text and reply.usage.completion_tokens == 8
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=8, temperature=0, stream=True
        )
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert "".join(pieces) == text  # greedy: the same reply, streamed over TLS
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=2, temperature=0
        )
        assert raw.headers[DECODE_HEADER] in deployment.workers  # https:// worker URLs


def test_peer_kv_fetch_between_tls_workers(pki, deployment):
    home, other = deployment.workers
    prompt = list(range(1000, 1000 + 100))
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    with tls_client(pki) as http:
        assert http.post(f"{home}/v1/completions", json=body).status_code == 200
        hinted = json.dumps({**body, "kv_peer": home}).encode()  # signed, as the router does
        vouch = sign(SECRET.encode(), "POST", "/v1/completions", DEFAULT_TENANT, hinted)
        r = http.post(f"{other}/v1/completions", content=hinted, headers={TENANT_HEADER: vouch})
        assert r.status_code == 200, r.text
        # The prompt's 6 full blocks, leased by the home over HTTPS and pulled.
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 6 * 16
    pulled = metric(other, 'splitserve:kv_peer_fetches_total{outcome="pulled"}', verify=pki.verify)
    assert pulled == 1


def test_a_plain_http_client_to_a_tls_port_fails_cleanly(pki, deployment):
    for url in (deployment.router, deployment.workers[0]):
        plain = url.replace("https://", "http://")
        with pytest.raises(httpx.TransportError):  # the server hangs up: no answer, no hang
            httpx.get(f"{plain}/health", timeout=10.0)
        with tls_client(pki) as http:  # ... and goes on serving HTTPS
            assert http.get(f"{url}/health").status_code == 200
    assert deployment.router_proc.poll() is None


# ---- fake workers: the router's upstream pool over TLS --------------------------------------


@pytest.fixture(scope="module")
def tls_fakes(pki: Pki) -> Iterator[list[FakeWorker]]:
    client = tls_client(pki)
    workers = [FakeWorker(name, tls=pki.server, client=client) for name in ("t1", "t2")]
    try:
        yield [w.wait_ready() for w in workers]
    finally:
        for w in workers:
            w.kill()
        client.close()


def test_the_router_streams_from_tls_workers_and_admits_one_by_url(pki, tls_fakes, make_router):
    first, second = tls_fakes
    for w in tls_fakes:
        w.reset()
        w.mode(greedy=True)
    options = {"worker_ca": pki.ca, "admin_key": "adm", "policy": "round-robin"}
    router = make_router(workers=[first.url], **options)
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 200}
    with HTTP.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    tokens = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[:-1]]
    assert tokens[:200] == [f"t{2 + i} " for i in range(200)]  # "hi": 2 prompt "tokens"
    admin = {"Authorization": "Bearer adm"}
    added = HTTP.post(router.url + "/workers", json={"url": second.url}, headers=admin)
    assert added.status_code == 201
    wait_until(lambda: probed_healthy(router, second.url, admin), 10, "the added worker's probe")
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    placed = {
        HTTP.post(router.url + "/v1/chat/completions", json=chat).headers[DECODE_HEADER]
        for _ in range(4)
    }
    assert placed == {first.url, second.url}


def probed_healthy(router, url: str, admin: dict) -> bool:
    workers = HTTP.get(router.url + "/workers", headers=admin).json()["workers"]
    return any(w["url"] == url and w["healthy"] and w["kv_blocks_total"] for w in workers)


@pytest.mark.parametrize("ca", ["other", "system"])
def test_a_worker_the_router_cannot_verify_is_failed_then_unhealthy(
    pki, tls_fakes, make_router, ca
):
    worker = tls_fakes[0]
    worker.reset()
    worker_ca = pki.other_ca if ca == "other" else None  # None: the system's trust store
    received = len(worker.seen())
    # One probe at start-up, then none: the requests alone open the worker's breaker.
    options = {"worker_ca": worker_ca, "max_retries": 0, "health_interval_s": 60}
    router = make_router(workers=[worker.url], **options)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    r = HTTP.post(router.url + "/v1/chat/completions", json=chat)
    assert r.status_code == 502  # the only worker failed: say why
    error = r.json()["error"]
    assert error["code"] == "worker_failed"
    assert "certificate failed verification" in error["message"], error["message"]
    for _ in range(3):  # ... and once its breaker opens, as for a worker that is down
        r = HTTP.post(router.url + "/v1/chat/completions", json=chat)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_worker"
    assert HTTP.get(router.url + "/health").status_code == 503
    assert len(worker.seen()) == received  # nothing reached it over an unverified connection


def test_regression_a_handshake_with_a_busy_worker_waits_as_a_plain_request_does(
    pki, tls_fakes, make_router
):
    # The handshake ran under the 2 s connect timeout: a worker whose event loop was busy
    # for longer failed the request (502 "timed out"), where the kernel would have accepted
    # a plain connection and the answer come late.
    worker = tls_fakes[1]
    worker.reset()
    router = make_router(workers=[worker.url], worker_ca=pki.ca, health_interval_s=60)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    answers: list[int] = []
    os.kill(worker.proc.pid, signal.SIGSTOP)
    try:
        sender = threading.Thread(
            target=lambda: answers.append(
                HTTP.post(router.url + "/v1/chat/completions", json=chat).status_code
            )
        )
        sender.start()
        time.sleep(3.0)  # past the connect timeout, with the handshake under way
    finally:
        os.kill(worker.proc.pid, signal.SIGCONT)
    sender.join(30)
    assert answers == [200]


def test_regression_a_tls_router_stops_at_once_with_idle_client_connections(pki, tls_fakes):
    # Closing an idle TLS connection at shutdown waited up to 30 s for the client's
    # close_notify, which a client holding it idle in its pool never sends.
    router, proc = start_router(pki, [tls_fakes[0].url])
    with tls_client(pki) as http:
        try:
            wait_until(lambda: _answers(http, router), 60, "the TLS router")
            started = time.monotonic()
            os.killpg(proc.pid, signal.SIGTERM)  # the client's connection is open and idle
            proc.wait(20)
            assert time.monotonic() - started < 10
        finally:
            stop_group(proc)


def _answers(http: httpx.Client, url: str) -> bool:
    try:
        return http.get(f"{url}/health").status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("ca", ["given", "none"])
def test_the_bench_client_verifies_a_tls_endpoint_by_its_ca(pki, tls_fakes, ca):
    worker = tls_fakes[0]
    worker.reset()
    worker.mode(greedy=True)
    endpoint = Endpoint(worker.url, ca=pki.ca if ca == "given" else None)
    load = Load(concurrency=2, duration_s=0.5, drain_s=5.0)
    run = asyncio.run(run_load(endpoint, RandomConfig(32, 4), load, progress=False))
    ok = [r for r in run.records if r.ok]
    if ca == "given":
        assert ok and len(ok) == len(run.records)
    else:  # the system's roots do not vouch for a test CA: every request fails, none hangs
        assert run.records and not ok
        assert {r.error for r in run.records} == {"ConnectError"}
