"""``splitserve serve --engine vllm --prefill 1 --decode 1``: vLLM P/D behind the router.

One deployment for the module (vLLM takes minutes to start here): a long prompt goes through
both legs, the decode worker pulls its KV from the prefill worker over NIXL (UCX/TCP), and
the greedy text equals the decode worker's own, computed locally from scratch (a request
with its own ``cache_salt`` shares no cached block with the others). Also: a short prompt
stays on the decode worker, and every vLLM thread computes on its worker's core after NIXL
pinned one elsewhere. Skipped when ``.venv-vllm`` is absent (``make install-vllm``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import psutil
import pytest
from procs import (
    free_port,
    metric,
    skip_without_vllm,
    start_launcher,
    stop_group,
    wait_serving,
)

from splitserve.cli import build_parser
from splitserve.cluster.vllm_worker import parse_cpus

skip_without_vllm()

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]  # vLLM starts slowly here
MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# ~290 tokens: over the router's remote-prefill threshold (64 tokens at 4 chars a token).
LONG = [{"role": "user", "content": "Explain how a hash table handles collisions. " * 32}]
EXTERNAL = "vllm:prompt_tokens_by_source_total"


class Deployment:
    def __init__(self, url: str, launcher: subprocess.Popen, log: list[str]) -> None:
        self.url, self.launcher, self.log = url, launcher, log
        workers = httpx.get(f"{url}/workers", headers=AUTH, timeout=10).json()["workers"]
        self.prefill = next(w["url"] for w in workers if w["role"] == "prefill")
        self.decode = next(w["url"] for w in workers if w["role"] == "decode")


@pytest.fixture(scope="module")
def deployment():
    port = free_port()
    argv = [sys.executable, "-m", "splitserve.cli", "serve", "--engine", "vllm"]
    argv += ["--port", str(port), "--prefill", "1", "--decode", "1"]
    argv += ["--threads-per-worker", "1", "--policy", "session"]
    argv += ["--dtype", "float32", "--kv-cache-gb", "0.5", "--max-model-len", "2048"]
    argv += ["--ready-timeout", "600"]
    log: list[str] = []
    # stderr too: the supervisors report the threads they bind there
    launcher, lines = start_launcher(
        argv, {**os.environ, "SPLITSERVE_API_KEY": KEY}, log=log, stderr=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(launcher, lines, url, timeout=660)
        yield Deployment(url, launcher, log)
    finally:
        stop_group(launcher, timeout=60)


def _client(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=300)


def _by_source(url: str, source: str) -> float:
    """vLLM's prompt tokens from ``source``: local_compute, local_cache_hit,
    external_kv_transfer."""
    text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=10).text
    lines = [ln for ln in text.splitlines() if ln.startswith(EXTERNAL + "{")]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if f'source="{source}"' in ln)


def _remote_prefills(url: str, outcome: str) -> float:
    name = f'splitserve:router_remote_prefills_total{{outcome="{outcome}"}}'
    return metric(url, name, AUTH)


def test_both_legs_give_the_decode_workers_own_greedy_text(deployment):
    d = deployment
    body = {"model": MODEL, "messages": LONG, "max_tokens": 24, "temperature": 0}
    local = httpx.post(
        f"{d.decode}/v1/chat/completions",
        json={**body, "cache_salt": "reference"},  # computed here, from nothing cached
        headers=AUTH,
        timeout=300,
    ).json()
    expected = local["choices"][0]["message"]["content"]
    prompt_tokens = local["usage"]["prompt_tokens"]
    assert prompt_tokens > 256 and len(expected) > 20  # more than two of vLLM's blocks
    pulled, ok = _by_source(d.decode, "external_kv_transfer"), _remote_prefills(d.url, "ok")
    client = _client(d.url)

    raw = client.chat.completions.with_raw_response.create(**body)
    assert raw.headers["x-splitserve-prefill-worker"] == d.prefill
    assert raw.headers["x-splitserve-decode-worker"] == d.decode
    assert raw.parse().choices[0].message.content == expected
    assert _by_source(d.decode, "external_kv_transfer") - pulled == prompt_tokens

    stream = client.chat.completions.create(  # a salt of its own: the whole prompt again
        **body, stream=True, extra_body={"cache_salt": "stream"}
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
    assert _by_source(d.decode, "external_kv_transfer") - pulled == 2 * prompt_tokens
    assert _remote_prefills(d.url, "ok") - ok == 2


def test_a_short_prompt_stays_on_the_decode_worker(deployment):
    d = deployment
    skipped = _remote_prefills(d.url, "skipped")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    raw = _client(d.url).chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0
    )
    assert "Paris" in raw.parse().choices[0].message.content
    assert "x-splitserve-prefill-worker" not in raw.headers
    assert _remote_prefills(d.url, "skipped") - skipped == 1


def test_every_vllm_thread_computes_on_its_workers_core(deployment):
    d = deployment
    assert any("bound 1 vLLM thread(s) back to cores" in line for line in d.log), (
        "NIXL pinned no thread away: the fix was not exercised"
    )
    inherited = os.sched_getaffinity(0)  # what the vLLM processes start with
    for url in (d.prefill, d.decode):
        leader = _listening(url)
        cores = set(parse_cpus(build_parser().parse_args(leader.parent().cmdline()[3:]).cpus))
        group = [leader, *leader.children(recursive=True)]
        engine = [p for p in group if p.name().startswith("VLLM::Worker")]
        assert len(engine) == 1, [p.name() for p in group]
        for proc in group:
            for allowed in _thread_affinities(proc):
                assert allowed == cores or (proc not in engine and allowed == inherited), (
                    url,
                    proc.name(),
                    allowed,
                )


def _listening(worker_url: str) -> psutil.Process:
    port = int(worker_url.rsplit(":", 1)[1])
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return psutil.Process(conn.pid)
    raise AssertionError(f"nothing listens on {worker_url}")


def _thread_affinities(proc: psutil.Process) -> list[set[int]]:
    """Each live thread's ``Cpus_allowed_list``, as the kernel shows it."""
    out = []
    for t in proc.threads():
        try:
            with open(f"/proc/{proc.pid}/task/{t.id}/status") as f:
                line = next(ln for ln in f if ln.startswith("Cpus_allowed_list"))
        except FileNotFoundError:  # a short-lived thread ended meanwhile
            continue
        out.append(set(parse_cpus(line.split()[1])))
    return out
