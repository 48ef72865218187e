"""Mid-stream migration: the token bookkeeping alone, then through the router on fake workers."""

from __future__ import annotations

import asyncio
import json

import pytest

from splitserve.router.migration import IncompleteStream, StreamLog, StreamRelay, resumable_request
from splitserve.router.proxy import DECODE_HEADER

from .conftest import HTTP
from .test_proxy import metric, urls

pytestmark = pytest.mark.timeout(120)


def sse(chunk: dict) -> bytes:
    return f"data: {json.dumps(chunk)}\n\n".encode()


def chat_chunk(text: str | None, ids: list[int] | None, **extra) -> dict:
    delta = {} if text is None else {"content": text}
    choice = {"index": 0, "delta": delta, "finish_reason": extra.pop("finish_reason", None)}
    if ids is not None:
        choice["token_ids"] = ids
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m"} | {
        "choices": [choice],
        **extra,
    }


def run(relay: StreamRelay, pieces: list[bytes]) -> tuple[list[dict], Exception | None]:
    """Relay ``pieces`` as one leg; the client's chunks and the error the leg ended with."""

    async def main():
        async def raw():
            for p in pieces:
                yield p

        out, error = b"", None
        try:
            async for b in relay.relay(raw()):
                out += b
        except IncompleteStream as e:
            error = e
        events = [e for e in out.decode().split("\n\n") if e]
        return [json.loads(e[6:]) if e != "data: [DONE]" else "DONE" for e in events], error

    return asyncio.run(main())


def test_first_leg_strips_ids_and_settles_only_tokens_whose_text_arrived():
    relay = StreamRelay(StreamLog.of({"max_tokens": 10}, chat=True), {"max_tokens": 10})
    role = chat_chunk("", None, prompt_token_ids=[1, 2, 3])
    role["choices"][0]["delta"]["role"] = "assistant"
    stream = b"".join(
        [
            sse(role),
            sse(chat_chunk("Hi", [50])),
            sse(chat_chunk("", [51])),
            sse(chat_chunk("", [52])),
        ]
    )
    # Split mid-event: the relay must reassemble events across reads.
    chunks, error = run(relay, [stream[:17], stream[17:60], stream[60:]])
    assert isinstance(error, IncompleteStream)
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"content": "", "role": "assistant"},
        {"content": "Hi"},
    ]  # the id-only chunks (text held back) are not forwarded
    assert all("prompt_token_ids" not in c and "token_ids" not in c["choices"][0] for c in chunks)
    log = relay.log
    assert (log.prompt_ids, log.settled, log.pending) == ([1, 2, 3], [50], [51, 52])
    assert relay.remaining() == 9
    body = relay.resume_body(9)
    assert body == {
        "prompt": [1, 2, 3, 50],
        "max_tokens": 9,
        "stream": True,
        "return_token_ids": True,
    }


def test_resumed_leg_reads_like_the_first_and_usage_counts_the_whole_request():
    original = {"max_tokens": 4, "temperature": 0, "stream_options": {"include_usage": True}}
    relay = StreamRelay(StreamLog.of(original, chat=True), original)
    run(relay, [sse(chat_chunk("", None, prompt_token_ids=[1, 2])), sse(chat_chunk("a", [9]))])
    body = relay.resume_body(relay.remaining())
    assert body["prompt"] == [1, 2, 9] and body["max_tokens"] == 3 and body["temperature"] == 0
    resumed = [
        {
            "id": "cmpl-2",
            "object": "text_completion",
            "created": 9,
            "model": "m",
            "prompt_token_ids": [1, 2, 9],
            "choices": [{"index": 0, "text": "b", "token_ids": [10], "finish_reason": None}],
        },
        {"id": "cmpl-2", "choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
        {
            "id": "cmpl-2",
            "choices": [],
            "usage": {
                "prompt_tokens": 3,
                "completion_tokens": 3,
                "total_tokens": 6,
                "prompt_tokens_details": {"cached_tokens": 3},
            },
        },
    ]
    chunks, error = run(relay, [b"".join(sse(c) for c in resumed) + b"data: [DONE]\n\n"])
    assert error is None and chunks[-1] == "DONE"
    text, finish, usage = chunks[:3]
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m"}
    assert text == head | {
        "choices": [
            {"index": 0, "delta": {"content": "b"}, "logprobs": None, "finish_reason": None}
        ],
        "usage": None,
    }
    assert finish["choices"][0]["delta"] == {} and finish["choices"][0]["finish_reason"] == "length"
    assert usage == head | {
        "choices": [],
        "usage": {
            "prompt_tokens": 2,
            "completion_tokens": 4,
            "total_tokens": 6,
            "prompt_tokens_details": {"cached_tokens": 2},
        },
    }


def test_a_spent_token_budget_finishes_without_a_worker():
    relay = StreamRelay(StreamLog.of({"prompt": "x", "max_tokens": 1}, chat=False), {})
    first = {"id": "c", "prompt_token_ids": [5], "choices": [{"text": "z", "token_ids": [6]}]}
    run(relay, [sse(first)])
    assert relay.remaining() == 0
    events = b"".join(relay.finish_locally()).decode().split("\n\n")
    assert json.loads(events[0][6:])["choices"][0]["finish_reason"] == "length"
    assert events[1] == "data: [DONE]"


def stream_text(router, path: str, body: dict, session: str) -> tuple[str, list[str], str]:
    """(decode worker header, client events, concatenated text) of one streamed request."""
    with HTTP.stream(
        "POST", router.url + path, json=body, headers={"X-Session-Id": session}, timeout=30.0
    ) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line]
    chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    assert all("error" not in c for c in chunks), events
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    text = "".join(
        ch["delta"].get("content", "") if "delta" in ch else ch["text"] for ch in choices
    )
    return r.headers[DECODE_HEADER], events, text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stream_migrates_when_its_worker_dies_mid_stream(workers3, make_router, path):
    router = make_router(workers=urls(workers3), health_interval_s=60)
    for w in workers3:
        w.mode(greedy=True)
    chat = path.endswith("chat/completions")
    prompt = {"messages": [{"role": "user", "content": "abc"}]} if chat else {"prompt": "abc"}
    body = {**prompt, "stream": True, "max_tokens": 8, "stream_options": {"include_usage": True}}
    home, clean_events, clean = stream_text(router, path, body, "mig")
    victim = next(w for w in workers3 if w.url == home)
    victim.mode(mode="die_midstream", die_after=3)
    seen_before = {w.url: len(w.seen()) for w in workers3}
    worker, events, text = stream_text(router, path, body, "mig")
    assert worker == home and text == clean == "".join(f"t{p} " for p in range(3, 11))
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1
    chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    assert len({c["id"] for c in chunks}) == 1  # one response, whoever wrote each part
    assert all("token_ids" not in ch for c in chunks for ch in c["choices"])
    assert chunks[-1]["usage"]["prompt_tokens"] == 3
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    assert metric(router, "splitserve:router_migrations_total") == 1
    resumed = [
        r["body"]
        for w in workers3
        if w is not victim
        for r in w.seen()[seen_before[w.url] :]
        if r["path"] == "/v1/completions"
    ]
    assert [(b["prompt"], b["max_tokens"]) for b in resumed] == [([97, 98, 99, 3, 4, 5], 5)]


def test_client_that_asked_for_token_ids_keeps_them_across_a_migration(workers3, make_router):
    router = make_router(workers=urls(workers3), health_interval_s=60)
    for w in workers3:
        w.mode(greedy=True)
    body = {"prompt": "ab", "stream": True, "max_tokens": 5, "return_token_ids": True}
    home = stream_text(router, "/v1/completions", body, "ids")[0]
    next(w for w in workers3 if w.url == home).mode(mode="die_midstream", die_after=2)
    _, events, _ = stream_text(router, "/v1/completions", body, "ids")
    chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    assert chunks[0]["prompt_token_ids"] == [97, 98]
    assert [i for c in chunks for i in c["choices"][0].get("token_ids", [])] == [2, 3, 4, 5, 6]


@pytest.mark.parametrize(
    ("extra", "resumable"),
    [
        ({}, True),
        ({"response_format": {"type": "text"}}, True),
        ({"response_format": {"type": "json_object"}}, False),
        ({"logprobs": True}, False),
        ({"frequency_penalty": 0.5}, False),
        ({"repetition_penalty": 1}, True),
        ({"repetition_penalty": 1.2}, False),
        ({"tools": [{"type": "function"}], "tool_choice": "none"}, True),
        ({"tools": [{"type": "function"}]}, False),
        ({"n": 1}, True),
        ({"n": 2}, False),
    ],
)
def test_streams_with_sampler_state_are_not_resumed_elsewhere(extra, resumable):
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, **extra}
    assert resumable_request(body) is resumable
