"""Constrained decoding and the sampling surface through a real worker and the official
``openai`` client: JSON formats, forced tool calls, logprobs, penalties, stop strings."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from tool_chat import WEATHER_TOOL, few_shot_tool_calls

TICKET = {
    "type": "object",
    "properties": {
        "priority": {"type": "string", "enum": ["low", "medium", "high"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 2},
        "owner": {
            "type": "object",
            "properties": {"team": {"type": "string", "maxLength": 20}},
            "required": ["team"],
            "additionalProperties": False,
        },
    },
    "required": ["priority", "tags", "owner"],
    "additionalProperties": False,
}
STRICT_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "maxLength": 40}},
            "required": ["query"],
        },
    },
}


@pytest.fixture(scope="module")
def client(worker) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{worker.url}/v1", api_key=worker.api_key, max_retries=0, timeout=120
    )


def chat(client, worker, content, **kw):
    messages = content if isinstance(content, list) else [{"role": "user", "content": content}]
    return client.chat.completions.create(model=worker.model, messages=messages, **kw)


def test_json_schema_output_validates(client, worker):
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "ticket", "schema": TICKET, "strict": True},
    }
    r = chat(
        client, worker, "My laptop is on fire!", max_tokens=120, temperature=0, response_format=fmt
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), TICKET)


def test_json_object_output_parses_and_streams_the_same(client, worker):
    kw = dict(max_tokens=100, temperature=0, response_format={"type": "json_object"})
    prompt = "Reply with a JSON object whose only key is the name of a cat."
    whole = chat(client, worker, prompt, **kw)
    assert whole.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(whole.choices[0].message.content), dict)
    chunks = chat(client, worker, prompt, stream=True, **kw)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content


def test_completions_take_a_response_format_too(client, worker):
    r = client.completions.create(
        model=worker.model,
        prompt="A JSON object describing a dog:",
        max_tokens=60,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].text), dict)


def _args(call, tool) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_tool_choice_required_returns_a_valid_call(client, worker):
    r = chat(
        client,
        worker,
        "What is the weather like in Lisbon?",
        max_tokens=80,
        temperature=0,
        tools=[STRICT_WEATHER, SEARCH_TOOL],
        tool_choice="required",
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    tools = {"get_weather": STRICT_WEATHER, "search": SEARCH_TOOL}
    for call in choice.message.tool_calls:
        _args(call, tools[call.function.name])


def test_named_tool_choice_calls_that_function_once(client, worker):
    r = chat(
        client,
        worker,
        "What is the weather like in Lisbon?",
        max_tokens=80,
        temperature=0,
        tools=[STRICT_WEATHER, SEARCH_TOOL],
        tool_choice={"type": "function", "function": {"name": "search"}},
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "search" and r.choices[0].finish_reason == "tool_calls"
    _args(call, SEARCH_TOOL)


def test_named_tool_choice_streams_the_call(client, worker):
    chunks = list(
        chat(
            client,
            worker,
            "Weather in Oslo?",
            max_tokens=80,
            temperature=0,
            tools=[STRICT_WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            stream=True,
        )
    )
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or ())]
    assert [c.function.name for c in calls] == ["get_weather"]
    _args(calls[0], STRICT_WEATHER)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_tool_call_arguments_follow_the_schema(client, worker):
    # The few-shot calls show {"city": ...}; the strict schema also requires "unit", which
    # the model alone leaves out: the constraint opens with the call and completes it.
    r = chat(
        client,
        worker,
        few_shot_tool_calls("Paris"),
        max_tokens=60,
        temperature=0,
        tools=[STRICT_WEATHER],
    )
    (call,) = r.choices[0].message.tool_calls
    assert _args(call, STRICT_WEATHER)["city"] == "Paris"


def test_chat_logprobs_shapes_streamed_and_not(client, worker):
    kw = dict(max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    r = chat(client, worker, "Name a colour.", **kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # Greedy: the picked token is the most likely one.
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert entry.bytes == list(entry.token.encode())
    streamed = [
        e
        for c in chat(client, worker, "Name a colour.", stream=True, **kw)
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    # The second run reads the prompt's KV from the prefix cache: the same tokens, logprobs
    # equal to float rounding.
    assert [e.token for e in streamed] == [e.token for e in content]
    for s, e in zip(streamed, content, strict=True):
        assert s.logprob == pytest.approx(e.logprob, abs=1e-3)


def test_completion_logprobs_shapes(client, worker):
    r = client.completions.create(
        model=worker.model, prompt="One, two, three,", max_tokens=6, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens).startswith(r.choices[0].text)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert all(len(top) <= 2 for top in lp.top_logprobs)


def test_penalties_change_greedy_output_as_expected(client, worker):
    prompt = "Repeat the word 'cat' twenty times."
    plain = chat(client, worker, prompt, max_tokens=40, temperature=0).choices[0].message.content
    penalized = (
        chat(client, worker, prompt, max_tokens=40, temperature=0, frequency_penalty=2.0)
        .choices[0]
        .message.content
    )
    assert penalized != plain
    assert penalized.lower().count("cat") < plain.lower().count("cat")
    presence = (
        chat(client, worker, prompt, max_tokens=40, temperature=0, presence_penalty=2.0)
        .choices[0]
        .message.content
    )
    assert presence != plain
    rep = (
        client.chat.completions.create(
            model=worker.model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=40,
            temperature=0,
            extra_body={"repetition_penalty": 1.5},
        )
        .choices[0]
        .message.content
    )
    assert rep != plain


def test_stop_string_straddling_chunks_is_cut_when_streaming(client, worker):
    kw = dict(max_tokens=24, temperature=0)
    full = chat(client, worker, "Write one sentence about the sea.", **kw)
    text = full.choices[0].message.content
    # A stop string that starts inside one token and ends inside a later one.
    stop = text[len(text) // 2 - 3 : len(text) // 2 + 3]
    chunks = chat(client, worker, "Write one sentence about the sea.", stream=True, stop=stop, **kw)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text[: text.find(stop)]


def test_include_usage_and_max_completion_tokens(client, worker):
    chunks = list(
        chat(
            client,
            worker,
            "Count to ten.",
            max_completion_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].choices == []


def _tool_with(parameters: dict, strict: bool) -> dict:
    return {
        "type": "function",
        "function": {"name": "f", "strict": strict, "parameters": parameters},
    }


def test_a_non_strict_tool_whose_schema_cannot_be_enforced_is_served_unconstrained(client, worker):
    r = chat(client, worker, "hi", max_tokens=4, tools=[_tool_with({"type": "wat"}, strict=False)])
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [WEATHER_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "x"}},
            },
            "tool_choice",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {"type": "wat"}},
                }
            },
            "response_format",
        ),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tools": [_tool_with({"type": "wat"}, strict=True)]}, "tools"),
        ({"presence_penalty": 3}, "presence_penalty"),
    ],
)
def test_unsupported_or_bad_sampling_fields_are_400s_naming_the_field(worker, body, param):
    import httpx

    r = httpx.post(
        f"{worker.url}/v1/chat/completions",
        headers=worker.headers,
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
