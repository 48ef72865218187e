"""``/v1/responses`` on a real worker through the official ``openai`` client: text and item
input, tool calls as ``function_call`` items, chains by ``previous_response_id`` that find
their KV cached, streaming events, stored responses per tenant, and the 400s."""

from __future__ import annotations

import json
import secrets

import httpx
import openai
import pytest
from procs import start_worker, stop_group, wait_healthy
from tool_chat import WEATHER_TOOL, few_shot_tool_calls

from splitserve.common.responses_api import CHAIN_HEADER, chain_of

SECRET = secrets.token_hex(16)
KEYS = {"alice": "sk-alice", "bob": "sk-bob"}
TOOL = {"type": "function", **WEATHER_TOOL["function"]}
INSTRUCTIONS = "You are a weather assistant. Answer briefly."


@pytest.fixture(scope="module")
def worker_url(tmp_path_factory):
    keys = tmp_path_factory.mktemp("responses") / "keys.json"
    keys.write_text(json.dumps([{"key": k, "tenant": t} for t, k in KEYS.items()]))
    url, proc = start_worker(["--max-model-len", "1024", "--api-keys", str(keys)], secret=SECRET)
    try:
        wait_healthy(url, proc)
        yield url
    finally:
        stop_group(proc)


def client_for(url: str, who: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS[who], max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def alice(worker_url) -> openai.OpenAI:
    return client_for(worker_url)


def tool_input() -> list[dict]:
    return [{"type": "message", **m} for m in few_shot_tool_calls("Paris")]


def test_text_input(alice):
    r = alice.responses.create(
        input="What is the capital of France?", max_output_tokens=12, temperature=0
    )
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.id.startswith("resp_") and chain_of(r.id) is not None
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert "Paris" in r.output_text
    assert r.usage.output_tokens <= 12
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_a_tool_call_is_a_function_call_item_and_its_output_continues(alice):
    first = alice.responses.create(
        input=tool_input(), tools=[TOOL], temperature=0, max_output_tokens=40
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert calls[0].call_id.startswith("call_")
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}
    second = alice.responses.create(
        input=[result],
        previous_response_id=first.id,
        tools=[TOOL],
        temperature=0,
        max_output_tokens=20,
    )
    assert second.previous_response_id == first.id and chain_of(second.id) == chain_of(first.id)
    # The whole first turn (prompt and the call the model wrote) is the second's cached prefix.
    context = first.usage.input_tokens + first.usage.output_tokens
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= 0.9 * context and cached >= context - 16


def test_items_with_function_call_output_without_a_chain(alice):
    items = tool_input()
    items.append(
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        }
    )
    items.append({"type": "function_call_output", "call_id": "call_1", "output": "rain, 12 C"})
    items.append(
        {"role": "user", "content": [{"type": "input_text", "text": "So, umbrella or not?"}]}
    )
    r = alice.responses.create(input=items, temperature=0, max_output_tokens=16)
    assert r.status in ("completed", "incomplete") and r.output_text


def test_a_chain_of_turns_reuses_its_kv(alice):
    r = alice.responses.create(
        input="Name a colour.", instructions=INSTRUCTIONS, temperature=0, max_output_tokens=8
    )
    for question in ("Name another one.", "And one more?"):
        nxt = alice.responses.create(
            input=question,
            previous_response_id=r.id,
            instructions=INSTRUCTIONS,
            temperature=0,
            max_output_tokens=8,
        )
        context = r.usage.input_tokens + r.usage.output_tokens
        assert nxt.usage.input_tokens > context
        assert nxt.usage.input_tokens_details.cached_tokens >= context - 16  # block granularity
        assert chain_of(nxt.id) == chain_of(r.id)
        r = nxt


def test_streaming_events_match_the_whole_response(alice):
    kw = {"input": "Write one sentence about the sea.", "temperature": 0, "max_output_tokens": 16}
    whole = alice.responses.create(**kw)
    events = list(alice.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert alice.responses.retrieve(final.id).output_text == deltas  # stored at the end


def test_streamed_tool_call_events(alice):
    events = list(
        alice.responses.create(
            input=tool_input(), tools=[TOOL], temperature=0, max_output_tokens=40, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(done[0].arguments) == {"city": "Paris"}
    final = events[-1].response
    assert [i.type for i in final.output][-1] == "function_call"


def test_get_and_delete_a_stored_response(alice):
    r = alice.responses.create(input="Say hi.", temperature=0, max_output_tokens=4)
    got = alice.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    alice.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.delete(r.id)
    with pytest.raises(openai.BadRequestError) as e:  # the chain is gone with it
        alice.responses.create(input="Again.", previous_response_id=r.id, max_output_tokens=4)
    assert e.value.body["code"] == "previous_response_not_found"


def test_delete_erases_the_chains_kv(worker_url, alice):
    # Instructions no other chain shares: erasure keeps blocks another live session made.
    kw = {"instructions": f"Run {secrets.token_hex(4)}. {INSTRUCTIONS}", "temperature": 0}
    kw["max_output_tokens"] = 8
    first = alice.responses.create(input="Count to three, please.", **kw)
    r = httpx.delete(
        f"{worker_url}/v1/responses/{first.id}",
        headers={"authorization": f"Bearer {KEYS['alice']}"},
    )
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert r.json()["kv_erasure"]["blocks"] > 0
    again = alice.responses.create(input="Count to three, please.", **kw)
    assert again.usage.input_tokens_details.cached_tokens == 0


def test_store_false_is_not_kept(alice):
    r = alice.responses.create(input="Say hi.", store=False, max_output_tokens=4)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(r.id)


def test_another_tenant_cannot_read_or_continue_a_response(worker_url, alice):
    r = alice.responses.create(input="A secret: 42.", max_output_tokens=4)
    bob = client_for(worker_url, "bob")
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        bob.responses.create(input="What was it?", previous_response_id=r.id, max_output_tokens=4)
    assert e.value.body["code"] == "previous_response_not_found"
    assert alice.responses.retrieve(r.id).id == r.id  # still alice's


def post(url: str, body: dict, headers: dict | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {KEYS['alice']}", **(headers or {})}
    return httpx.post(f"{url}/v1/responses", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "reasoning": {"effort": "low"}}, "reasoning"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": "hi", "parallel_tool_calls": False}, "parallel_tool_calls"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"role": "user", "content": "hi", "foo": 1}]}, "input[0].foo"),
        ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens"),
        ({"input": "hi", "temperature": "hot"}, "temperature"),
        ({"input": []}, "input"),
        ({"input": "hi", "seed": 2**63}, "seed"),
        ({"input": "hi", "resume": {"prompt_token_ids": []}}, "resume.prompt_token_ids"),
        # The router's remote prefill handshake: a client's own, unsigned, is refused.
        ({"input": "hi", "kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
    ],
)
def test_unsupported_or_bad_fields_are_a_400_naming_them(worker_url, body, param):
    r = post(worker_url, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_unknown_previous_response_is_a_400(worker_url):
    r = post(worker_url, {"input": "hi", "previous_response_id": "resp_" + "0" * 48})
    assert r.status_code == 400
    error = r.json()["error"]
    assert (
        error["code"] == "previous_response_not_found" and error["param"] == "previous_response_id"
    )


def test_a_resume_that_cannot_go_on_here_is_a_400_naming_it(worker_url):
    chain = "d" * 32
    named = {CHAIN_HEADER: chain}
    body = {"input": "Name three colours.", "max_output_tokens": 8, "temperature": 0}
    streamed = post(worker_url, {**body, "stream": True, "return_token_ids": True}, named)
    events = [json.loads(x[6:]) for x in streamed.text.splitlines() if x.startswith("data: ")]
    ids = [e for e in events if e["type"] == "splitserve.token_ids"]
    prompt = ids[0]["prompt_token_ids"]
    output = [t for e in ids for t in e["token_ids"]]
    resume = {
        "prompt_token_ids": prompt,
        "output_token_ids": output[:4],  # their text was released: a message is open
        "response_id": f"resp_{chain}{'0' * 16}",
        "created_at": 1,
        "message_id": "msg_1",
        "sequence_number": 8,
    }
    ok = {**body, "stream": True, "resume": resume}
    assert post(worker_url, ok, named).status_code == 200
    for bad, param in [
        ({**ok, "stream": False}, "stream"),
        ({**ok, "resume": {**resume, "response_id": "resp_" + "e" * 48}}, "resume.response_id"),
        ({**ok, "resume": {**resume, "prompt_token_ids": prompt[1:]}}, "resume.prompt_token_ids"),
        ({**ok, "resume": {**resume, "message_id": None}}, "resume.message_id"),
    ]:
        r = post(worker_url, bad, named)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
