"""``n > 1`` through a real worker and the official ``openai`` client: one choice per engine
sequence, the prompt computed once and shared through the prefix cache, seeded choices
reproducible, streams that reassemble to the whole answer, constrained and tool-calling
choices, and the combinations that stay a 400."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import jsonschema
import openai
import pytest
from procs import metric
from tool_chat import WEATHER_TOOL

from splitserve.common.tenants import Tenants
from splitserve.worker.choices import choice_seed, request_blocks
from splitserve.worker.server import create_app
from tests.worker.fake_engine import FakeEngine

BLOCK = 16
HITS = 'splitserve:kv_tier_hits_total{tier="device"}'
MISSES = 'splitserve:kv_tier_misses_total{tier="device"}'
POEM = [{"role": "user", "content": "Write one line about the sea."}]


@pytest.fixture(scope="module")
def client(worker) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{worker.url}/v1", api_key=worker.api_key, max_retries=0, timeout=120
    )


def chat(client, worker, messages=POEM, **kw):
    return client.chat.completions.create(model=worker.model, messages=messages, **kw)


def texts(response) -> list[str]:
    assert [c.index for c in response.choices] == list(range(len(response.choices)))
    return [c.message.content for c in response.choices]


def test_greedy_choices_are_equal_and_usage_sums_them(client, worker):
    one = chat(client, worker, max_tokens=8, temperature=0)
    three = chat(client, worker, max_tokens=8, temperature=0, n=3)
    assert texts(three) == [one.choices[0].message.content] * 3
    assert [c.finish_reason for c in three.choices] == [one.choices[0].finish_reason] * 3
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.total_tokens == three.usage.prompt_tokens + three.usage.completion_tokens


def test_the_prompt_is_computed_once_and_shared_through_the_cache(client, worker):
    # A prompt no earlier request began with: choice 0 misses every reusable block, and each
    # later choice finds all of them (the block holding the last token is always computed).
    prompt = f"{uuid.uuid4().hex} " + "the quick brown fox jumps over the lazy dog " * 6
    hits, misses = metric(worker.url, HITS), metric(worker.url, MISSES)
    cached = metric(worker.url, "splitserve:cached_prompt_tokens_total")
    r = client.completions.create(
        model=worker.model, prompt=prompt, max_tokens=4, temperature=0, n=4
    )
    reusable = (r.usage.prompt_tokens - 1) // BLOCK
    assert reusable >= 3
    assert metric(worker.url, MISSES) - misses == reusable
    assert metric(worker.url, HITS) - hits == 3 * reusable
    assert metric(worker.url, "splitserve:cached_prompt_tokens_total") - cached == (
        3 * reusable * BLOCK
    )
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # the prompt as choice 0 found it
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert len({c.text for c in r.choices}) == 1


def test_seeded_choices_differ_and_repeat(client, worker):
    kw = dict(max_tokens=12, temperature=1.0, seed=1234, n=3)
    first, again = chat(client, worker, **kw), chat(client, worker, **kw)
    assert texts(first) == texts(again)
    assert len(set(texts(first))) > 1
    alone = chat(client, worker, max_tokens=12, temperature=1.0, seed=1234)
    assert texts(first)[0] == alone.choices[0].message.content  # choice 0 keeps the seed


def test_a_stream_of_two_choices_reassembles_to_the_whole_answer(client, worker):
    kw = dict(max_tokens=10, temperature=1.0, seed=99, n=2)
    whole = chat(client, worker, **kw)
    stream = chat(client, worker, stream=True, stream_options={"include_usage": True}, **kw)
    parts, finish, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                assert c.index not in finish
                finish[c.index] = c.finish_reason
    assert [parts[0], parts[1]] == texts(whole)
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_a_text_completion_stream_carries_each_choice_index(worker):
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "n": 2}
    body |= {"stream": True}
    chunks = []
    with httpx.stream(
        "POST", f"{worker.url}/v1/completions", json=body, headers=worker.headers, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    by_index: dict[int, str] = {0: "", 1: ""}
    finishes = []
    for chunk in chunks:
        (choice,) = chunk["choices"]
        by_index[choice["index"]] += choice["text"]
        if choice["finish_reason"] is not None:
            finishes.append(choice["index"])
    assert sorted(finishes) == [0, 1]
    assert by_index[0] == by_index[1] != ""


def test_every_choice_follows_the_json_schema(client, worker):
    schema = {
        "type": "object",
        "properties": {
            "mood": {"type": "string", "enum": ["calm", "stormy"]},
            "waves": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["mood", "waves"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "sea", "schema": schema}}
    r = chat(client, worker, max_tokens=40, temperature=1.0, seed=5, n=3, response_format=fmt)
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), schema)


def test_every_choice_carries_its_logprobs(client, worker):
    r = chat(client, worker, max_tokens=5, temperature=1.0, seed=3, n=2, logprobs=True)
    for c in r.choices:
        assert "".join(t.token for t in c.logprobs.content).startswith(c.message.content)
    assert sum(len(c.logprobs.content) for c in r.choices) == r.usage.completion_tokens


def test_every_choice_of_a_forced_tool_call_is_parsed(client, worker):
    session = f"n-tools-{uuid.uuid4().hex}"
    r = chat(
        client,
        worker,
        [{"role": "user", "content": "What is the weather in Paris?"}],
        max_tokens=60,
        temperature=1.0,
        seed=11,
        n=2,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        extra_headers={"X-Session-Id": session},
    )
    for c in r.choices:
        assert c.finish_reason == "tool_calls"
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather"
        assert isinstance(json.loads(call.function.arguments), dict)
    # The calls pinned the session's KV for its next turn; erase it, leaving no pin behind
    # for the tests that wait for an idle pool.
    erased = httpx.delete(f"{worker.url}/v1/sessions/{session}", headers=worker.headers)
    assert erased.status_code == 200, erased.text
    assert erased.json()["blocks"] > 0 and erased.json()["in_use"] == 0


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 2}, "best_of"),
        ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 1}, "best_of"),
        ("/v1/responses", {"input": "hi", "n": 2}, "n"),
        ("/v1/chat/completions", {"messages": POEM, "n": 129}, "n"),
    ],
)
def test_unsupported_combinations_are_400_naming_the_field(worker, path, body, param):
    r = httpx.post(f"{worker.url}{path}", json=body, headers=worker.headers, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_choice_seeds_are_stable_and_distinct():
    assert choice_seed(42, 0) == 42
    seeds = [choice_seed(42, i) for i in range(128)]
    assert len(set(seeds)) == 128
    assert seeds == [choice_seed(42, i) for i in range(128)]
    assert all(0 <= s < 2**63 for s in seeds[1:])
    assert choice_seed(-5, 1) != choice_seed(5, 1)


def test_a_request_of_n_choices_counts_the_shared_prompt_blocks_once():
    # 40 prompt tokens: 2 reusable blocks shared; each choice holds ceil(50/16) - 2 = 2.
    assert request_blocks(40, 10, 1, 16) == 4
    assert request_blocks(40, 10, 3, 16) == 2 + 3 * 2
    assert request_blocks(16, 16, 2, 16) == 0 + 2 * 2  # the only full block holds the last token


def test_a_tenants_kv_block_quota_counts_every_choice(tmp_path):
    # "hi" plus 60 tokens: 4 blocks a choice, none shared (no full prompt block); a tenant
    # allowed 8 blocks runs n=2 and is refused n=3, naming the limit.
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps([{"key": "sk-n", "tenant": "t", "limits": {"kv_blocks": 8}}]))
    app = create_app(FakeEngine(), tenants=Tenants.load(keys))
    body = {"prompt": "hi", "max_tokens": 60, "temperature": 0}

    async def main() -> list[httpx.Response]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            headers = {"Authorization": "Bearer sk-n"}
            async with httpx.AsyncClient(
                transport=transport, base_url="http://test", headers=headers, timeout=30
            ) as client:
                return [await client.post("/v1/completions", json={**body, "n": n}) for n in (2, 3)]

    two, three = asyncio.run(main())
    assert two.status_code == 200, two.text
    assert [c["index"] for c in two.json()["choices"]] == [0, 1]
    assert two.json()["usage"]["completion_tokens"] == 120
    assert three.status_code == 429, three.text
    assert "kv_blocks" in three.json()["error"]["message"]


def test_leaving_a_stream_of_choices_aborts_every_choice(worker):
    body = {"prompt": "Count to a thousand:", "max_tokens": 400, "n": 3, "ignore_eos": True}
    with httpx.stream(
        "POST",
        f"{worker.url}/v1/completions",
        json={**body, "stream": True},
        headers=worker.headers,
        timeout=60,
    ) as r:
        lines = r.iter_lines()  # held: a dropped line iterator closes the response
        assert next(line for line in lines if line.startswith("data: {"))
        assert in_flight_becomes(worker, 3)
    assert in_flight_becomes(worker, 0)


def in_flight_becomes(worker, count: int, timeout: float = 15.0) -> bool:
    """Whether the worker's running plus waiting requests reach ``count`` (its load is
    published after each engine step)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        load = worker.load()
        if load["running"] + load["waiting"] == count:
            return True
        time.sleep(0.02)
    return False
