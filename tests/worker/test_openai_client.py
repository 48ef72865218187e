"""The real worker through the official ``openai`` client, as users will drive it."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from tool_chat import WEATHER_TOOL, few_shot_tool_calls

from splitserve.common.sampling_params import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "List three colours.",
]


@pytest.fixture(scope="module")
def client(worker) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{worker.url}/v1", api_key=worker.api_key, max_retries=0, timeout=60
    )


def chat(client, worker, content: str, **kw):
    return client.chat.completions.create(
        model=worker.model, messages=[{"role": "user", "content": content}], **kw
    )


def test_models_lists_the_served_model(client, worker):
    assert [m.id for m in client.models.list().data] == [worker.model]


def test_chat_non_streaming(client, worker):
    r = chat(client, worker, PROMPTS[0], max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == worker.model
    assert choice.message.role == "assistant" and "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_matches_non_streaming(client, worker):
    whole = chat(client, worker, PROMPTS[1], max_tokens=16, temperature=0)
    chunks = list(
        chat(
            client,
            worker,
            PROMPTS[1],
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == whole.choices[0].finish_reason and set(finish[:-1]) == {None}
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
        whole.usage.total_tokens,
    )
    # The second run of the same prompt finds its full blocks in the prefix cache.
    cached = usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < usage.prompt_tokens and cached % 16 == 0


def test_completions_and_usage_are_consistent(client, worker, offline_llm):
    prompt = "The three primary colours are"
    r = client.completions.create(
        model=worker.model,
        prompt=prompt,
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(offline_llm.tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 7 and r.usage.total_tokens == r.usage.prompt_tokens + 7
    by_ids = client.completions.create(
        model=worker.model,
        prompt=offline_llm.tokenizer.encode(prompt),
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert by_ids.choices[0].text == r.choices[0].text


def test_default_completion_length_is_16_tokens(client, worker):
    r = client.completions.create(
        model=worker.model, prompt="Once upon a time", extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 16


def test_repeated_prefix_is_reported_as_cached(client, worker):
    prompt = "A long shared prefix that fills more than two KV blocks of sixteen tokens. " * 3
    client.completions.create(model=worker.model, prompt=prompt, max_tokens=1)
    r = client.completions.create(model=worker.model, prompt=prompt, max_tokens=1)
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached >= 32 and cached % 16 == 0 and cached < r.usage.prompt_tokens


def test_seed_makes_sampling_reproducible(client, worker):
    kw = dict(max_tokens=16, temperature=1.0, seed=1234)
    a = chat(client, worker, PROMPTS[2], **kw).choices[0].message.content
    b = chat(client, worker, PROMPTS[2], **kw).choices[0].message.content
    assert a == b


def test_stop_string_cuts_the_reply(client, worker):
    kw = dict(
        model=worker.model,
        prompt="The days of the week are Monday,",
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kw).choices[0].text
    stop = full[len(full) // 2 :][:4]
    assert stop.strip(), full
    r = client.completions.create(**kw, stop=[stop])
    assert r.choices[0].text == full[: full.find(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_sixteen_concurrent_streams_all_complete(worker):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await client.chat.completions.create(
            model=worker.model,
            messages=[{"role": "user", "content": f"Count to {i}."}],
            max_tokens=8,
            temperature=0.7,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        return text, usage.completion_tokens

    async def main() -> list[tuple[str, int]]:
        async with openai.AsyncOpenAI(
            base_url=f"{worker.url}/v1", api_key=worker.api_key, max_retries=0, timeout=120
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    results = asyncio.run(main())
    assert [n for _, n in results] == [8] * 16
    assert all(text for text, _ in results)


def test_greedy_replies_match_the_offline_engine(client, worker, offline_llm):
    params = SamplingParams(max_tokens=12, temperature=0)
    for prompt in PROMPTS[:2]:
        offline = offline_llm.chat([{"role": "user", "content": prompt}], params)[0]
        online = chat(client, worker, prompt, max_tokens=12, temperature=0)
        assert online.choices[0].message.content == offline.outputs[0].text, prompt
        offline = offline_llm.generate(prompt, params)[0]
        online = client.completions.create(
            model=worker.model, prompt=prompt, max_tokens=12, temperature=0
        )
        assert online.choices[0].text == offline.outputs[0].text, prompt


def test_tool_conversation_is_accepted(client, worker):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"},
    ]
    r = client.chat.completions.create(
        model=worker.model, messages=messages, tools=tools, max_tokens=8, temperature=0
    )
    assert r.choices[0].message.content is not None and r.usage.completion_tokens >= 1


def test_a_reply_in_tool_call_format_becomes_tool_calls(client, worker):
    messages = few_shot_tool_calls("Paris")
    r = client.chat.completions.create(
        model=worker.model, messages=messages, tools=[WEATHER_TOOL], max_tokens=40, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # Without tools the same reply is plain text: the parser only runs when tools are offered.
    plain = client.chat.completions.create(
        model=worker.model, messages=messages, max_tokens=40, temperature=0
    )
    assert plain.choices[0].finish_reason == "stop" and not plain.choices[0].message.tool_calls
    assert plain.choices[0].message.content.startswith("<tool_call>")


def test_streamed_tool_calls_arrive_as_deltas_without_markup(client, worker):
    stream = client.chat.completions.create(
        model=worker.model,
        messages=few_shot_tool_calls("Paris"),
        tools=[WEATHER_TOOL],
        max_tokens=40,
        temperature=0,
        stream=True,
    )
    content, calls, finish = "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert "<tool_call>" not in content and finish == "tool_calls"
    (call,) = calls
    assert call.index == 0 and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_client_written_kv_transfer_params_are_refused(client, worker):
    # Only the router may name a transfer (tests/disagg sends them signed, as it does).
    params = {"do_remote_decode": False, "trace": "abc"}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=worker.model, prompt="hi", max_tokens=1, extra_body={"kv_transfer_params": params}
        )
    assert e.value.body["param"] == "kv_transfer_params"
