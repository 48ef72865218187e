"""Peer KV fetch with two real workers over loopback: a turn sent to B naming A (the
session's home, as the router does with ``kv_peer``) pulls the prompt's KV that A holds."""

from __future__ import annotations

import random

import httpx
import pytest
from procs import as_router, free_port, metric, start_worker, stop_group, wait_healthy

SECRET = "peer-test-secret"
API_KEY = "sk-peer-test"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
BS = 16
MAX_TOKENS = 8

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def peers() -> dict[str, str]:
    """Workers A and B, both lending and pulling; they load in parallel."""
    args = ["--kv-peer", "--kv-cache-gb", "0.1", "--api-key", API_KEY]
    procs = {name: start_worker(args, secret=SECRET) for name in ("a", "b")}
    try:
        for url, proc in procs.values():
            wait_healthy(url, proc)
        yield {name: url for name, (url, _) in procs.items()}
    finally:
        for _, proc in procs.values():
            stop_group(proc)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def complete(url: str, prompt: list[int], **extra) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    return as_router(url, "/v1/completions", body, SECRET, timeout=120)


def answer(r: httpx.Response) -> tuple[str, int]:
    """The reply's text and how many prompt tokens came from the prefix cache."""
    assert r.status_code == 200, r.text
    data = r.json()
    return data["choices"][0]["text"], data["usage"]["prompt_tokens_details"]["cached_tokens"]


def m(url: str, name: str) -> float:
    return metric(url, name, HEADERS)


def leased(url: str) -> int:
    return httpx.get(f"{url}/load", headers=HEADERS, timeout=10).json()["kv_blocks_leased"]


def test_a_moved_turn_pulls_what_the_home_holds_and_answers_the_same(peers):
    a, b = peers["a"], peers["b"]
    prompt, suffix = tokens(1, 200), tokens(2, 40)
    text_a, cached_a = answer(complete(a, prompt))
    assert cached_a == 0
    sent, granted = m(a, "splitserve:kv_blocks_sent"), m(a, "splitserve:kv_peer_leases_total")
    text_b, cached_b = answer(complete(b, prompt + suffix, kv_peer=a))
    # A holds the prompt's 12 full blocks; B pulled them and computed the rest.
    pulled = len(prompt) // BS
    assert cached_b == pulled * BS
    assert m(b, 'splitserve:kv_peer_fetches_total{outcome="pulled"}') == 1
    assert m(b, "splitserve:kv_peer_blocks_received_total") == pulled
    assert m(a, "splitserve:kv_blocks_sent") - sent == pulled
    assert m(a, "splitserve:kv_peer_leases_total") - granted == 1
    # The lease ended when B had the blocks: A's references are back.
    assert leased(a) == 0
    assert m(a, 'splitserve:kv_leases_ended_total{reason="released"}') >= 1
    # A computes the same prompt from its own cache: the same greedy reply.
    text_home, _ = answer(complete(a, prompt + suffix))
    assert text_b == text_home


def test_a_full_pull_matches_a_prompt_computed_from_scratch(peers):
    a, b = peers["a"], peers["b"]
    prompt = tokens(3, 150)
    alone, cached = answer(complete(a, prompt))
    assert cached == 0
    before = m(b, "splitserve:kv_peer_blocks_received_total")
    text, cached = answer(complete(b, prompt, kv_peer=a + "/"))
    usable = (len(prompt) - 1) // BS  # the block with the last token is always computed
    assert text == alone and cached == usable * BS
    assert m(b, "splitserve:kv_peer_blocks_received_total") - before == usable
    # Asked again, B holds all it could use: it does not even ask A.
    leases = m(a, "splitserve:kv_peer_leases_total")
    assert answer(complete(b, prompt, kv_peer=a)) == (alone, usable * BS)
    assert m(b, 'splitserve:kv_peer_fetches_total{outcome="held_locally"}') == 1
    assert m(a, "splitserve:kv_peer_leases_total") == leases


def test_a_home_that_holds_nothing_leaves_the_prompt_to_local_compute(peers):
    a, b = peers["a"], peers["b"]
    prompt = tokens(4, 120)
    empty = m(a, 'splitserve:kv_peer_leases_total{outcome="empty"}')
    text, cached = answer(complete(b, prompt, kv_peer=a))
    assert cached == 0
    assert m(b, 'splitserve:kv_peer_fetches_total{outcome="nothing_held"}') == 1
    assert m(a, 'splitserve:kv_peer_leases_total{outcome="empty"}') == empty + 1
    assert answer(complete(a, prompt)) == (text, 0)


def test_a_dead_home_is_a_counted_fallback_not_an_error(peers):
    a, b = peers["a"], peers["b"]
    prompt = tokens(5, 120)
    dead = f"http://127.0.0.1:{free_port()}"
    r = complete(b, prompt, kv_peer=dead, stream=True)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    assert m(b, 'splitserve:kv_peer_fallbacks_total{reason="unreachable"}') == 1
    assert m(b, 'splitserve:kv_peer_fetches_total{outcome="fallback"}') == 1
    text, _ = answer(complete(b, prompt))
    assert answer(complete(a, prompt)) == (text, 0)


@pytest.mark.parametrize("hint", [5, "not a url", "ftp://127.0.0.1:1", "http://", ["x"]])
def test_a_malformed_hint_is_a_400_naming_kv_peer(peers, hint):
    r = complete(peers["b"], tokens(6, 20), kv_peer=hint)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "kv_peer" and error["type"] == "invalid_request_error"


def test_the_lease_endpoint_needs_the_api_key_and_a_prompt(peers):
    url = f"{peers['a']}/v1/kv/lease"
    r = httpx.post(url, json={"prompt_token_ids": [1, 2, 3]}, timeout=10)
    assert r.status_code == 401
    r = httpx.post(url, json={"prompt_token_ids": []}, headers=HEADERS, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_token_ids"
    r = httpx.post(url, json={"prompt_token_ids": [1, 2, 3]}, headers=HEADERS, timeout=10)
    assert r.json() == {"object": "kv.lease", "blocks": 0, "kv_transfer_params": None}
