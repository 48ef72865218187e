"""What the real worker does with bad requests and vanishing clients: never a 5xx, never a hang."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.worker.conftest import MAX_MODEL_LEN

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http(worker):
    with httpx.Client(base_url=worker.url, headers=worker.headers, timeout=60) as client:
        yield client


def post(http: httpx.Client, path: str, body) -> httpx.Response:
    # json.dumps escapes lone surrogates (\ud800) as JSON allows; httpx's json= cannot send them.
    return http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


def assert_error(r: httpx.Response, status: int, param: str | None = None, words: str = ""):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == (
        "invalid_request_error" if status in (400, 401, 404) else error["type"]
    )
    assert error["param"] == param, error
    assert words.lower() in error["message"].lower(), error


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        (CHAT, {"messages": []}, "messages", "at least 1"),
        (CHAT, {}, "messages", "required"),
        (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", ""),
        (CHAT, {"messages": USER, "temperature": "hot"}, "temperature", "number"),
        (CHAT, {"messages": USER, "temperature": 3}, "temperature", "2"),
        (CHAT, {"messages": USER, "top_p": 0}, "top_p", ""),
        (CHAT, {"messages": USER, "max_tokens": 0}, "max_tokens", ""),
        (CHAT, {"messages": USER, "max_tokens": True}, "max_tokens", "integer"),
        (COMPLETIONS, {"prompt": "x", "n": 2, "best_of": 1}, "best_of", "n > 1"),
        (CHAT, {"messages": USER, "stop": [""]}, "stop", "non-empty"),
        (
            CHAT,
            {"messages": USER, "stream_options": {"include_usage": True}},
            "stream_options",
            "stream",
        ),
        (COMPLETIONS, {"prompt": "x", "suffix": "y"}, "suffix", "not supported"),
        (CHAT, {"messages": USER, "max_tokens": MAX_MODEL_LEN}, "max_tokens", "context length"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.0.content",
            "text",
        ),
        (COMPLETIONS, {"prompt": ""}, "prompt", "empty"),
        (COMPLETIONS, {"prompt": []}, "prompt", "empty"),
        (COMPLETIONS, {"prompt": ["a", "b"]}, "prompt", "one prompt"),
        (COMPLETIONS, {"prompt": [10**9]}, "prompt", "token ids"),
        (COMPLETIONS, {"prompt": [1] * MAX_MODEL_LEN}, "prompt", "maximum context length"),
        (COMPLETIONS, {"prompt": "x", "echo": True}, "echo", "not supported"),
        (COMPLETIONS, {"prompt": "\ud800"}, None, "utf-8"),
    ],
)
def test_invalid_requests_are_400_with_the_openai_error_body(http, path, body, param, words):
    assert_error(post(http, path, body), 400, param, words)


def test_malformed_json_is_400(http):
    for raw in (b"{bad", b"", b"[1, 2]", b'"text"', b"\xff\xfe", b"[" * 100_000):
        assert_error(http.post(CHAT, content=raw), 400)


def test_prompt_too_long_says_so(http):
    r = http.post(CHAT, json={"messages": [{"role": "user", "content": "word " * MAX_MODEL_LEN}]})
    assert_error(r, 400, "messages", f"maximum context length is {MAX_MODEL_LEN} tokens")
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_unknown_model_is_404(http):
    r = http.post(COMPLETIONS, json={"model": "gpt-9", "prompt": "hi"})
    assert_error(r, 404, "model", "gpt-9")
    assert r.json()["error"]["code"] == "model_not_found"


def test_missing_or_wrong_api_key_is_401(worker):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": worker.api_key}):
        r = httpx.post(f"{worker.url}{COMPLETIONS}", json={"prompt": "hi"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{worker.url}/health").status_code == 200
    assert "splitserve:num_requests_running" in httpx.get(f"{worker.url}/metrics").text


def wait_for_idle_pool(worker, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        load = worker.load()
        if load["running"] == 0 and load["waiting"] == 0 and load["kv_blocks_used"] == 0:
            return load
        time.sleep(0.05)
    raise AssertionError(f"blocks were not returned to the pool: {worker.load()}")


def wait_for_running(worker, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        load = worker.load()
        if load["running"] == 1 and load["kv_blocks_used"] > 0:
            return load
        time.sleep(0.05)
    raise AssertionError(f"the request never ran: {worker.load()}")


LONG = {"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True}


def test_disconnect_mid_stream_aborts_and_frees_blocks(worker):
    wait_for_idle_pool(worker)
    with httpx.Client(base_url=worker.url, headers=worker.headers, timeout=60) as client:
        with client.stream("POST", COMPLETIONS, json={**LONG, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            wait_for_running(worker)
        # Leaving the block closed the connection mid-stream.
    wait_for_idle_pool(worker)


def test_disconnect_while_waiting_for_a_whole_reply_aborts(worker):
    wait_for_idle_pool(worker)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{worker.url}{COMPLETIONS}", json=LONG, headers=worker.headers, timeout=1.5)
    wait_for_idle_pool(worker)


# ---- fuzzing ----------------------------------------------------------------------------------
# Three kinds of bodies: valid requests, valid requests with a few fields replaced by random
# JSON, and random JSON. The length fields only ever hold tiny or invalid values, so the
# requests that do run stay short.

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
_json = st.recursive(
    _scalars | st.just("\ud800"),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_length = st.integers(-3, 3) | st.booleans() | st.floats(-1, 4) | st.text(max_size=3)
_text = st.text(min_size=1, max_size=30)
_options = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 10**6),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": st.lists(_text, max_size=2) | _text,
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "user": _text,
    "kv_transfer_params": st.dictionaries(st.text(max_size=8), _scalars, max_size=2),
}
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "developer"]), "content": _text}
)
_chat = st.fixed_dictionaries(
    {"messages": st.lists(_message, min_size=1, max_size=3), "max_tokens": st.integers(1, 3)},
    optional=_options,
)
_completion = st.fixed_dictionaries(
    {
        "prompt": _text | st.lists(st.integers(0, 49151), min_size=1, max_size=8),
        "max_tokens": st.integers(1, 3),
    },
    optional=_options,
)
_fields = st.sampled_from(
    [
        *_options,
        "messages",
        "prompt",
        "model",
        "n",
        "stream_options",
        "tools",
        "tool_choice",
        "logprobs",
        "echo",
        "best_of",
        "suffix",
        "unknown_field",
    ]
)


def _mutated(valid: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    changes = st.dictionaries(_fields, _json, min_size=1, max_size=2)
    lengths = st.dictionaries(
        st.sampled_from(["max_tokens", "max_completion_tokens"]), _length, max_size=1
    )
    return st.builds(lambda body, c, n: {**body, **c, **n}, valid, changes, lengths)


_bodies = st.one_of(
    st.tuples(st.just(CHAT), _chat | _mutated(_chat)),
    st.tuples(st.just(COMPLETIONS), _completion | _mutated(_completion)),
    st.tuples(st.sampled_from([CHAT, COMPLETIONS]), _json),
)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_bodies)
def test_fuzzed_bodies_never_get_a_5xx(http, body):
    path, payload = body
    r = post(http, path, payload)
    assert r.status_code < 500, (payload, r.text)
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_worker_still_serves_after_the_fuzzing(http):
    r = http.post(COMPLETIONS, json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def test_prefill_leg_without_cluster_secret_is_a_400(worker):
    body = {"prompt": "hi", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    r = httpx.post(f"{worker.url}/v1/completions", json=body, headers=worker.headers)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "kv_transfer_params"
