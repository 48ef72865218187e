"""Hand-written hostile requests against a real worker and a real router in front of it.

Each is a 4xx with an OpenAI error body (``{"error": {message, type, param, code}}``),
answered within a bounded time, and the worker stays healthy and unchanged (last test).
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from fuzzing import MAX_MODEL_LEN, aftermath

from .conftest import MAX_BODY_MB

pytestmark = pytest.mark.timeout(300)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
LIMIT = int(MAX_BODY_MB * 2**20)
ANSWER_S = 30.0  # every hostile request is answered within this


def send(target, path: str, body: object | bytes, **headers) -> httpx.Response:
    """``body`` as JSON (``json.dumps`` escapes lone surrogates, as JSON allows), or raw."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with target.client() as client:
        started = time.monotonic()
        r = client.post(path, content=raw, headers={"content-type": "application/json", **headers})
    assert time.monotonic() - started < ANSWER_S
    return r


def assert_error(r: httpx.Response, status: int = 400, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert error["type"] == "invalid_request_error", error
    if code is not None:
        assert error["code"] == code, error
    return error


def nested(depth: int, leaf: object = 0) -> object:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


# ---- oversize bodies ------------------------------------------------------------------------


def test_declared_oversize_body_is_413_before_it_is_read(target):
    """A terabyte announced and never sent: the 413 comes at once, not after reading it."""
    host, port = target.url.removeprefix("http://").split(":")
    auth = target.headers["Authorization"]
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Authorization: {auth}\r\nContent-Length: {2**40}\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=ANSWER_S) as sock:
        sock.sendall(head.encode() + b'{"messages": ')
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.split()[1] == b"413", answer
    body = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_oversize_body_is_413(target):
    big = {"messages": [{"role": "user", "content": "a" * LIMIT}]}
    assert_error(send(target, CHAT, big), 413)


def test_oversize_chunked_body_is_413(target):
    """No Content-Length: the body is counted as it arrives."""

    def chunks():
        yield b'{"prompt": "'
        for _ in range(LIMIT // 2**16 + 1):
            yield b"a" * 2**16
        yield b'"}'

    with target.client() as client:
        r = client.post(COMPLETIONS, content=chunks(), headers={"content-type": "application/json"})
    assert_error(r, 413)


def test_a_body_under_the_limit_is_read(target):
    under = {"prompt": "a " * (LIMIT // 4)}
    assert_error(send(target, COMPLETIONS, under), 400, "context_length_exceeded")


# ---- strings that are not text --------------------------------------------------------------

SURROGATE = "\ud800"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, {"messages": [{"role": "user", "content": SURROGATE}]}),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]}),
        (CHAT, {"messages": USER, "stop": [SURROGATE]}),
        (CHAT, {"messages": USER, "model": SURROGATE}),
        (CHAT, {"messages": USER, "user": "x\udfff"}),
        (CHAT, {"messages": USER, SURROGATE: 1}),
        (CHAT, {"messages": [{"role": "user", "content": "hi", "name": SURROGATE}]}),
        (COMPLETIONS, {"prompt": SURROGATE}),
        (COMPLETIONS, {"prompt": ["a\udc00b"]}),
    ],
)
def test_lone_surrogates_are_400(target, path, body):
    assert_error(send(target, path, body))


@pytest.mark.parametrize(
    "raw",
    [b'{"prompt": "\xff\xfe"}', b'{"prompt": "\xed\xa0\x80"}', b"\xff\xfe{\x00}\x00", b"\x00"],
)
def test_bytes_that_are_not_utf8_are_400(target, raw):
    assert_error(send(target, COMPLETIONS, raw))


# ---- deep nesting ---------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1_000, 10_000, 100_000])
@pytest.mark.parametrize(
    "where",
    ["body", "content", "extra field", "tool arguments", "tools", "kv_transfer_params"],
)
def test_deep_nesting_is_400(target, where, depth):
    deep = nested(depth)
    call = {"function": {"name": "f", "arguments": {"x": deep}}}
    bodies = {
        "body": deep,
        "content": {"messages": [{"role": "user", "content": deep}]},
        "extra field": {"messages": USER, "max_tokens": 1, "x": deep},
        "tool arguments": {"messages": [{"role": "assistant", "tool_calls": [call]}]},
        "tools": {"messages": USER, "tools": [{"function": {"name": "f", "parameters": deep}}]},
        "kv_transfer_params": {"messages": USER, "kv_transfer_params": {"x": deep}},
    }
    assert_error(send(target, CHAT, _dumps(bodies[where])))


@pytest.mark.parametrize("depth", range(900, 1000, 8))
def test_nesting_near_the_recursion_limit_is_never_a_5xx(target, depth):
    """Depths the parser takes but a later re-serialisation (the router's forwarded body,
    a stream's resumable copy) might not: an answer either way, never a 5xx."""
    body = {"messages": USER, "max_tokens": 1, "stream": True, "x": nested(depth)}
    r = send(target, CHAT, _dumps(body))
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert_error(r)


def _dumps(value: object) -> bytes:
    """JSON for lists nested past what ``json.dumps`` recurses through."""
    if isinstance(value, list):
        depth = 0
        while isinstance(value, list) and len(value) == 1:
            value, depth = value[0], depth + 1
        return b"[" * depth + _dumps(value) + b"]" * depth
    if isinstance(value, dict):
        items = b",".join(json.dumps(k).encode() + b":" + _dumps(v) for k, v in value.items())
        return b"{" + items + b"}"
    if isinstance(value, list):
        return b"[" + b",".join(_dumps(v) for v in value) + b"]"
    return json.dumps(value).encode()


# ---- prompts past the context ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, {"messages": [{"role": "user", "content": "word " * MAX_MODEL_LEN}]}),
        (CHAT, {"messages": [{"role": "user", "content": "w "}] * MAX_MODEL_LEN}),
        (COMPLETIONS, {"prompt": "word " * MAX_MODEL_LEN}),
        (COMPLETIONS, {"prompt": [1] * MAX_MODEL_LEN}),
        (COMPLETIONS, {"prompt": [[1] * 100_000]}),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}),
        (CHAT, {"messages": USER, "max_tokens": MAX_MODEL_LEN - 1}),
        (CHAT, {"messages": USER, "max_completion_tokens": MAX_MODEL_LEN}),
    ],
)
def test_prompts_past_the_context_are_400(target, path, body):
    assert_error(send(target, path, body), 400, "context_length_exceeded")


def test_a_prompt_filling_the_context_but_one_token_is_answered(target):
    """Chat without ``max_tokens`` means "the rest of the context": here, one token."""
    ids = [1] * (MAX_MODEL_LEN - 1)
    r = send(target, COMPLETIONS, {"prompt": ids, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


# ---- huge numbers ---------------------------------------------------------------------------

HUGE = [10**6, 2**63, 2**64, 10**100, -1, 0, 1e300, "1"]


@pytest.mark.parametrize("value", HUGE, ids=repr)
@pytest.mark.parametrize(
    ("path", "field", "extra"),
    [
        (CHAT, "n", {}),
        (COMPLETIONS, "n", {}),
        (CHAT, "max_tokens", {}),
        (CHAT, "max_completion_tokens", {}),
        (COMPLETIONS, "max_tokens", {}),
        (CHAT, "top_logprobs", {"logprobs": True}),
        (CHAT, "top_logprobs", {}),
        (COMPLETIONS, "logprobs", {}),
        (COMPLETIONS, "best_of", {}),
    ],
)
def test_huge_counts_are_400(target, path, field, extra, value):
    if value == 0 and field in ("top_logprobs", "logprobs"):
        pytest.skip("0 asks for no alternatives, as OpenAI takes it: a valid request")
    if value == 10**6 and field == "n":
        value = 129  # past the most choices a request may ask for
    base = {"messages": USER} if path == CHAT else {"prompt": "hi"}
    assert_error(send(target, path, {**base, **extra, field: value}))


def test_integers_too_long_to_parse_are_400(target):
    raw = b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}"
    assert_error(send(target, COMPLETIONS, raw))


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_non_finite_numbers_are_400(target, literal):
    raw = b'{"prompt": "hi", "temperature": ' + literal + b"}"
    assert_error(send(target, COMPLETIONS, raw))


# ---- malformed tools and tool messages ------------------------------------------------------

FN = {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}


@pytest.mark.parametrize(
    "change",
    [
        {"tools": "get_weather"},
        {"tools": [1]},
        {"tools": [{}]},
        {"tools": [{"type": "function"}]},
        {"tools": [{"type": "function", "function": {}}]},
        {"tools": [{"type": "function", "function": {"name": ""}}]},
        {"tools": [{"type": "function", "function": {"name": 7}}]},
        {"tools": [{"type": "retrieval", "function": FN}]},
        {"tools": [{"type": "function", "function": {**FN, "parameters": "object"}}]},
        {"tools": [{"type": "function", "function": FN}], "tool_choice": {"function": {}}},
        {"tool_choice": 3},
    ],
    ids=repr,
)
def test_malformed_tools_are_400(target, change):
    assert_error(send(target, CHAT, {"messages": USER, "max_tokens": 1, **change}))


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "assistant", "tool_calls": "get_weather"}],
        [{"role": "assistant", "tool_calls": [{}]}],
        [{"role": "assistant", "tool_calls": [{"function": {}}]}],
        [{"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f"}}]}],
        [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}],
        [{"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": 1}],
        [{"role": "tool", "content": {"temperature": 20}}],
        [{"role": "tool", "content": [{"type": "image_url", "image_url": "x"}]}],
        [{"role": "function", "content": "20C"}],
    ],
    ids=repr,
)
def test_malformed_tool_messages_are_400(target, messages):
    assert_error(send(target, CHAT, {"messages": [*USER, *messages], "max_tokens": 1}))


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "tool", "content": "20C"}],  # no call before it, no id
        [{"role": "tool", "content": "20C", "tool_call_id": "call_9"}],  # an id never issued
        [{"role": "assistant", "tool_calls": [CALL]}],  # a call never answered
        [{"role": "assistant", "tool_calls": [{**CALL, "function": {**FN, "arguments": "{"}}]}],
    ],
    ids=repr,
)
def test_odd_but_wellformed_tool_conversations_are_answered(target, messages):
    """Conversations the OpenAI schema allows: an answer or a 400, never a 5xx."""
    r = send(target, CHAT, {"messages": [*USER, *messages], "max_tokens": 1})
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert_error(r)


# ---- afterwards -----------------------------------------------------------------------------


def test_the_worker_is_healthy_and_unchanged_after_all_this(fuzz_stack):
    assert aftermath(fuzz_stack) == []
