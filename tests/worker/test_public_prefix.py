"""A tenant's public prefix on real processes: a keys file that declares a system prompt,
two keys that opt in to sharing it, one that does not, and another tenant that declares the
same prompt. The keys that opt in find each other's KV of the system prompt and of nothing
after it; no one else finds any.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

import httpx
import pytest
from procs import free_port, start_worker, stop_group, wait_healthy

SECRET = secrets.token_hex(16)
BS = 16
SYSTEM = (
    "You are the support assistant of Acme Rockets. Answer in one short sentence, name the "
    "product line when you know it, never promise a delivery date, and refer safety "
    "questions to the launch desk. Stay polite and precise; do not guess at part numbers. "
    "Customers are engineers: use metric units, and say so when a question is out of scope."
)
KEYS = {
    "acme-1": "sk-acme-1",
    "acme-2": "sk-acme-2",
    "acme-private": "sk-acme-3",
    "globex": "sk-globex",
    "acme-3": "sk-acme-4",  # these two call through the router only
    "acme-3-private": "sk-acme-5",
}
PREFIX = {"public_prefixes": [{"messages": [{"role": "system", "content": SYSTEM}]}]}
KEYS_FILE = {
    "keys": [
        {"key": KEYS["acme-1"], "tenant": "acme", "share_public_prefix": True},
        {"key": KEYS["acme-2"], "tenant": "acme", "share_public_prefix": True},
        {"key": KEYS["acme-private"], "tenant": "acme"},
        {"key": KEYS["globex"], "tenant": "globex", "share_public_prefix": True},
        {"key": KEYS["acme-3"], "tenant": "acme", "share_public_prefix": True},
        {"key": KEYS["acme-3-private"], "tenant": "acme"},
    ],
    "tenants": {"acme": PREFIX, "globex": PREFIX},  # the same text: still two tenants
}


def chat(url: str, who: str, question: str) -> dict:
    body = {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
        ],
        "max_tokens": 8,
        "temperature": 0,
        "return_token_ids": True,
    }
    headers = {"authorization": f"Bearer {KEYS[who]}"}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def shared_blocks_tokens(answer: dict, url: str) -> int:
    """The whole blocks of the prompt that lie within the rendered system prompt."""
    return in_common(answer["prompt_token_ids"], _system_only_ids(url))


def in_common(a: list[int], b: list[int]) -> int:
    """The tokens in the whole leading blocks ``a`` and ``b`` agree on."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n // BS * BS


def _system_only_ids(url: str) -> list[int]:
    body = {
        "messages": [{"role": "system", "content": SYSTEM}],
        "max_tokens": 1,
        "return_token_ids": True,
        "cache_salt": "probe",  # its own cache: it must not warm anyone's
    }
    headers = {"authorization": f"Bearer {KEYS['acme-private']}"}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["prompt_token_ids"]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    root = tmp_path_factory.mktemp("public-prefix")
    keys = root / "keys.json"
    keys.write_text(json.dumps(KEYS_FILE))
    worker_url, worker = start_worker(["--api-keys", str(keys)], secret=SECRET)
    router = None
    try:
        wait_healthy(worker_url, worker)
        port = free_port()
        argv = [sys.executable, "-m", "splitserve.cli", "router", "--port", str(port)]
        argv += ["--workers", worker_url, "--api-keys", str(keys), "--log-level", "warning"]
        env = _env({"SPLITSERVE_KV_SECRET": SECRET})
        router = subprocess.Popen(argv, env=env, start_new_session=True)
        router_url = f"http://127.0.0.1:{port}"
        wait_healthy(router_url, router, timeout=60)
        yield worker_url, router_url
    finally:
        if router is not None:
            stop_group(router)
        stop_group(worker)


def _env(extra: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **extra}


def test_keys_that_opt_in_share_the_system_prompt_and_nothing_after_it(deployment):
    worker, _ = deployment
    question = "Which engine does the Roadrunner Mk II use?"
    first = chat(worker, "acme-1", question)
    assert cached(first) == 0
    shared = shared_blocks_tokens(first, worker)
    full = (len(first["prompt_token_ids"]) - 1) // BS * BS  # all a repeat could reuse
    assert 2 * BS <= shared < full  # the system prompt spans blocks; the question more
    # The other key that opted in: the system prompt's blocks, not the question's, although
    # its prompt is the very same.
    second = chat(worker, "acme-2", question)
    assert cached(second) == shared
    assert cached(chat(worker, "acme-1", question)) == full  # its own blocks, for itself
    # Greedy output is the same with and without the hit.
    assert second["choices"][0]["message"] == first["choices"][0]["message"]
    # A different question from the second key: the system prompt, then what the key's own
    # earlier prompt has in common with this one (never the first key's).
    other = chat(worker, "acme-2", "How tall is the launch tower?")
    own = in_common(other["prompt_token_ids"], second["prompt_token_ids"])
    assert cached(other) == max(shared, own)


def test_no_one_else_finds_the_shared_blocks(deployment):
    worker, _ = deployment
    question = "Is the Coyote booster reusable?"
    first = chat(worker, "acme-1", question)
    private = chat(worker, "acme-private", question)  # same tenant, did not opt in
    globex = chat(worker, "globex", question)  # another tenant, the same declared prompt
    assert cached(private) == 0 and cached(globex) == 0
    assert private["choices"][0]["message"] == first["choices"][0]["message"]
    assert globex["choices"][0]["message"] == first["choices"][0]["message"]
    assert cached(chat(worker, "acme-private", question)) > 0  # its own, once it sent it
    assert cached(chat(worker, "globex", "Another question?")) > 0  # globex's own public


def test_through_the_router_the_principal_is_signed(deployment):
    worker, router = deployment
    question = "What fuel does the Acme Mk III burn?"
    first = chat(router, "acme-3", question)  # a key's first request
    shared = shared_blocks_tokens(first, worker)
    assert cached(first) == shared  # what the other keys that opted in left
    assert cached(chat(router, "acme-3-private", question)) == 0


@pytest.mark.parametrize(
    "keys, message",
    [
        (
            [{"key": "k", "tenant": "a", "share_public_prefix": True}],
            "share_public_prefix needs public_prefixes declared for tenant 'a'",
        ),
        (
            {"keys": [{"key": "k", "tenant": "a"}], "tenants": {"a": {"public_prefixes": [""]}}},
            "public prefix 0 is an empty text",
        ),
    ],
)
def test_a_bad_declaration_stops_the_worker_and_router_with_a_clear_error(tmp_path, keys, message):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(keys))
    for command in (["worker"], ["router", "--workers", "http://127.0.0.1:9"]):
        argv = [sys.executable, "-m", "splitserve.cli", *command, "--api-keys", str(path)]
        done = subprocess.run(
            argv, env=_env({"SPLITSERVE_KV_SECRET": SECRET}), capture_output=True, text=True
        )
        assert done.returncode == 2, done.stderr
        assert message in done.stderr and "Traceback" not in done.stderr
