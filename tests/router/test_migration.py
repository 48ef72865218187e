"""Mid-stream migration: the token bookkeeping alone, then through the router on fake workers."""

from __future__ import annotations

import asyncio
import json

import pytest

from splitserve.router.migration import IncompleteStream, StreamLog, StreamRelay
from splitserve.router.proxy import DECODE_HEADER
from splitserve.router.resume_mode import ResumeMode, resume_mode

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


@pytest.mark.parametrize("mode", [ResumeMode.CONTINUE, ResumeMode.EXTEND])
def test_first_leg_strips_ids_and_settles_only_tokens_whose_text_arrived(mode):
    original = {"messages": [], "max_tokens": 10}
    relay = StreamRelay(StreamLog.of(original, chat=True), original, mode)
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
    log, choice = relay.log, relay.log.choices[0]
    assert (log.prompt_ids, choice.settled, choice.pending) == ([1, 2, 3], [50], [51, 52])
    assert relay.remaining() == 9
    body = relay.resume_body(9)
    if mode is ResumeMode.CONTINUE:  # builtin workers: the request, after the settled ids
        assert relay.resume_path == "/v1/chat/completions"
        assert body == original | {
            "stream": True,
            "return_token_ids": True,
            "resume": {"prompt_token_ids": [1, 2, 3], "output_token_ids": [50]},
        }
    else:  # vLLM workers: a text completion of the prompt's and the settled ids
        assert relay.resume_path == "/v1/completions"
        assert body == {
            "prompt": [1, 2, 3, 50],
            "max_tokens": 9,
            "stream": True,
            "return_token_ids": True,
        }


def test_resumed_completion_leg_reads_like_the_first_and_usage_counts_the_whole_request():
    original = {"max_tokens": 4, "temperature": 0, "stream_options": {"include_usage": True}}
    relay = StreamRelay(StreamLog.of(original, chat=True), original, ResumeMode.EXTEND)
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


def role_chunk(**extra) -> dict:
    role = chat_chunk("", None, **extra)
    role["choices"][0]["delta"]["role"] = "assistant"
    return role


CALLS = [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f"}}]


def continued_leg(*choices: tuple[str | None, list[int] | None, dict]) -> bytes:
    """A continuation's stream from another worker: its own id and created, the prompt's ids
    on its first chunk, then a chunk per ``(text, ids, delta extras)``."""
    out = b""
    for i, (text, ids, more) in enumerate(choices):
        chunk = chat_chunk(text, ids, **({"prompt_token_ids": [1, 2, 3]} if i == 0 else {}))
        chunk |= {"id": "chatcmpl-2", "created": 9}
        chunk["choices"][0]["delta"] |= more
        out += sse(chunk)
    return out + b"data: [DONE]\n\n"


def test_a_continuation_reads_as_the_first_leg_tool_calls_included():
    original = {"messages": [], "tools": [{"type": "function"}], "stream": True}
    relay = StreamRelay(StreamLog.of(original, chat=True), original)
    first = [role_chunk(prompt_token_ids=[1, 2, 3]), chat_chunk("Hi", [50]), chat_chunk("", [51])]
    run(relay, [b"".join(sse(c) for c in first)])
    assert relay.resume_body(100)["resume"]["output_token_ids"] == [50]
    ending = chat_chunk(None, [], finish_reason="tool_calls") | {"id": "chatcmpl-2"}
    leg = continued_leg(("", [51], {}), ("", [52], {}), (None, None, {"tool_calls": CALLS}))
    chunks, error = run(relay, [leg[:-14] + sse(ending) + leg[-14:]])
    assert error is None and chunks[-1] == "DONE"
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m"}
    calls = {"index": 0, "delta": {"tool_calls": CALLS}, "finish_reason": None}
    assert chunks[:-1] == [  # the id-only chunks are dropped, the calls kept
        head | {"choices": [calls]},
        head | {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    ]
    assert relay.log.choices[0].calls_sent and relay.log.choices[0].settled == [50, 51, 52]


def test_a_client_that_asked_for_ids_gets_each_once_across_a_migration():
    original = {"messages": [], "return_token_ids": True}
    relay = StreamRelay(StreamLog.of(original, chat=True), original)
    first = [role_chunk(prompt_token_ids=[1, 2, 3]), chat_chunk("Hi", [50]), chat_chunk("", [51])]
    run(relay, [b"".join(sse(c) for c in first) + sse(chat_chunk("", [52]))])
    relay.resume_body(100)  # 51 and 52 are regenerated: the client has them already
    leg = continued_leg(("", [51], {}), ("", [52], {}), ("!", [53], {}))
    chunks, _ = run(relay, [leg])
    assert [c["choices"][0] for c in chunks[:-1]] == [
        {"index": 0, "delta": {"content": "!"}, "finish_reason": None, "token_ids": [53]}
    ]
    assert "prompt_token_ids" not in chunks[0] and chunks[0]["id"] == "chatcmpl-1"
    assert relay.log.choices[0].ids_sent == 4


def test_a_stream_that_broke_after_its_tool_calls_is_finished_without_a_worker():
    relay = StreamRelay(StreamLog.of({"messages": []}, chat=True), {})
    calls = chat_chunk(None, [7]) | {"prompt_token_ids": [1]}
    calls["choices"][0]["delta"]["tool_calls"] = CALLS
    chunks, error = run(relay, [sse(calls)])
    assert isinstance(error, IncompleteStream) and chunks[0]["choices"][0]["delta"] == {
        "tool_calls": CALLS
    }
    assert relay.log.ended  # resume.py then ends the stream itself:
    events = b"".join(relay.finish_locally()).decode().split("\n\n")
    assert json.loads(events[0][6:])["choices"][0]["finish_reason"] == "tool_calls"


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


@pytest.mark.parametrize("engine", ["builtin", "vllm"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stream_migrates_when_its_worker_dies_mid_stream(workers3, make_router, path, engine):
    router = make_router(workers=urls(workers3), health_interval_s=60, worker_engine=engine)
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
    resumed = [r for w in workers3 if w is not victim for r in w.seen()[seen_before[w.url] :]]
    assert len(resumed) == 1
    leg = resumed[0]["body"]
    if engine == "builtin":  # the request itself, going on after the ids the client has
        assert resumed[0]["path"] == path and leg["max_tokens"] == 8
        assert leg["resume"] == {"prompt_token_ids": [97, 98, 99], "output_token_ids": [3, 4, 5]}
    else:
        assert resumed[0]["path"] == "/v1/completions" and "resume" not in leg
        assert (leg["prompt"], leg["max_tokens"]) == ([97, 98, 99, 3, 4, 5], 5)


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


def test_a_client_cannot_send_the_routers_resume_field(workers3, make_router):
    router = make_router(workers=urls(workers3), health_interval_s=60)
    forged = {"prompt_token_ids": [1], "output_token_ids": [2, 3]}
    body = {"prompt": "forged", "stream": True, "max_tokens": 2, "resume": forged}
    home = stream_text(router, "/v1/completions", body, "forged")[0]
    [seen] = [r["body"] for w in workers3 if w.url == home for r in w.seen()[-1:]]
    assert seen["prompt"] == "forged" and "resume" not in seen


E, R = ResumeMode.EXTEND, ResumeMode.REPLAY


@pytest.mark.parametrize(
    ("extra", "on_vllm"),
    [
        ({}, E),
        ({"temperature": 0.7}, E),  # fresh draws, as any unseeded run
        ({"seed": 3, "temperature": 0}, E),
        ({"seed": 3, "temperature": 1}, R),
        ({"seed": 3}, R),  # vLLM's default temperature is 1
        ({"response_format": {"type": "text"}}, E),
        ({"response_format": {"type": "json_object"}}, R),
        ({"logprobs": False}, E),
        ({"logprobs": True, "top_logprobs": 2}, R),
        ({"frequency_penalty": 0.5}, R),
        ({"presence_penalty": 0.0}, E),
        ({"repetition_penalty": 1}, E),
        ({"repetition_penalty": 1.2}, R),
        ({"stop": ["\n\n"]}, R),  # a stop string may straddle the resume point
        ({"logit_bias": {"42": 5}}, R),  # any field an extension does not carry
        ({"tools": [{"type": "function"}], "tool_choice": "none"}, E),
        ({"tools": [{"type": "function"}]}, R),
        ({"tools": [{"type": "function"}], "tool_choice": "required"}, R),
        ({"n": 1}, E),
        ({"n": 2}, R),
        ({"echo": True}, None),  # vLLM leaves the echoed prompt out with return_token_ids
    ],
)
def test_how_streams_are_resumed_elsewhere(extra, on_vllm):
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, **extra}
    assert resume_mode(body) is ResumeMode.CONTINUE  # builtin workers resume every stream
    assert resume_mode(body, "vllm") is on_vllm


@pytest.mark.parametrize(
    ("extra", "on_vllm"),
    [
        ({}, E),
        ({"logprobs": 2}, E),
        ({"logprobs": 0}, E),
        ({"logprobs": 2, "echo": True}, None),
        ({"logprobs": 2, "n": 2}, R),
    ],
)
def test_a_text_completions_logprobs_extend_on_vllm_but_not_with_echo(extra, on_vllm):
    body = {"prompt": "hi", "stream": True, **extra}
    assert resume_mode(body) is ResumeMode.CONTINUE
    assert resume_mode(body, "vllm") is on_vllm


def test_regression_a_resumed_vllm_leg_keeps_the_tenants_cache_salt():
    # The extension leg carried no ``cache_salt``: its prompt, the delivered text included,
    # was cached where other tenants' requests could hit it.
    original = {"prompt": "p", "max_tokens": 4, "cache_salt": "tenant-salt"}
    relay = StreamRelay(StreamLog.of(original, chat=False), original, ResumeMode.EXTEND)
    run(relay, [sse(text_lp_chunk("t50", [50], 0, prompt_token_ids=[1, 2]))])
    assert relay.resume_body(3)["cache_salt"] == "tenant-salt"


def text_lp_chunk(text: str, ids: list[int], offset: int, **extra) -> dict:
    """A text completion chunk in vLLM's shape (the prompt's ids, if given, in the choice),
    one log-probability per id, token ``i`` written ``t<i>``, offsets from ``offset``."""
    tokens = [f"t{i}" for i in ids]
    logprobs = {
        "tokens": tokens,
        "token_logprobs": [-0.5] * len(ids),
        "top_logprobs": [{t: -0.5} for t in tokens],
        "text_offset": [offset + 3 * k for k in range(len(ids))],
    }
    choice = {"index": 0, "text": text, "logprobs": logprobs, "token_ids": ids}
    choice["finish_reason"] = extra.pop("finish_reason", None)
    choice["prompt_token_ids"] = extra.pop("prompt_token_ids", None)
    return {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m"} | {
        "choices": [choice],
        **extra,
    }


def test_regression_a_vllm_text_completion_names_its_prompt_ids_in_the_choice():
    # vLLM puts a streamed text completion's prompt ids in its first choice, not beside the
    # choices as in chat: read there, they make the stream resumable.
    original = {"prompt": "p", "max_tokens": 4, "stream": True}
    relay = StreamRelay(StreamLog.of(original, chat=False), original, ResumeMode.EXTEND)
    run(relay, [sse(text_lp_chunk("t50", [50], 0, prompt_token_ids=[1, 2]))])
    assert relay.log.resumable and relay.resume_body(3)["prompt"] == [1, 2, 50]


def test_a_resumed_text_completion_carries_logprobs_at_the_whole_outputs_offsets():
    original = {"prompt": "p", "logprobs": 1, "max_tokens": 6, "stream": True}
    relay = StreamRelay(StreamLog.of(original, chat=False), original, ResumeMode.EXTEND)
    # Token 51's text is held back, but its chunk (with its log-probabilities) went out.
    first = [text_lp_chunk("t50", [50], 0, prompt_token_ids=[1, 2]), text_lp_chunk("", [51], 3)]
    chunks, _ = run(relay, [b"".join(sse(c) for c in first)])
    assert "prompt_token_ids" not in chunks[0]["choices"][0]  # the client did not ask
    body = relay.resume_body(relay.remaining())
    assert body["prompt"] == [1, 2, 50] and body["logprobs"] == 1 and body["max_tokens"] == 5
    # The resumed leg counts its offsets from its own start: the end of t50's text.
    leg = [text_lp_chunk("", [51], 0, prompt_token_ids=[1, 2, 50])]
    leg.append(text_lp_chunk("t51t52", [52], 3))
    leg.append(text_lp_chunk("", [], 6, finish_reason="length"))
    leg[-1]["choices"][0]["logprobs"] = None
    chunks, error = run(relay, [b"".join(sse(c) for c in leg) + b"data: [DONE]\n\n"])
    assert error is None and chunks[-1] == "DONE"
    got = [(c["choices"][0]["text"], c["choices"][0]["logprobs"]) for c in chunks[:-1]]
    assert got == [
        (
            "t51t52",
            {
                "tokens": ["t52"],  # t51's went out before the failure
                "token_logprobs": [-0.5],
                "top_logprobs": [{"t52": -0.5}],
                "text_offset": [6],  # as in an undisturbed stream: after t50 and t51
            },
        ),
        ("", None),
    ]
    assert chunks[0]["id"] == "cmpl-1"


def lp_chunk(text: str, ids: list[int], index: int = 0, **extra) -> dict:
    """A chat chunk of choice ``index`` with one log-probability entry per id."""
    chunk = chat_chunk(text, ids, **extra)
    chunk["choices"][0]["index"] = index
    content = [{"token": f"t{i}", "logprob": -0.5, "bytes": [], "top_logprobs": []} for i in ids]
    chunk["choices"][0]["logprobs"] = {"content": content, "refusal": None}
    return chunk


def test_a_client_gets_each_tokens_logprobs_once_across_a_migration():
    original = {"messages": [], "logprobs": True, "stream": True}
    relay = StreamRelay(StreamLog.of(original, chat=True), original)
    # Token 51's text is held back, but its chunk (with its log-probabilities) went out.
    first = [role_chunk(prompt_token_ids=[1, 2, 3]), lp_chunk("Hi", [50]), lp_chunk("", [51])]
    chunks, _ = run(relay, [b"".join(sse(c) for c in first)])
    assert [c["choices"][0]["logprobs"]["content"][0]["token"] for c in chunks[1:]] == [
        "t50",
        "t51",
    ]
    assert relay.resume_body(100)["resume"]["output_token_ids"] == [50]  # 51 is regenerated
    leg = [lp_chunk("", [51], prompt_token_ids=[1, 2, 3]), lp_chunk("!", [52])]
    leg.append(chat_chunk(None, None, finish_reason="stop"))
    chunks, error = run(relay, [b"".join(sse(c) for c in leg) + b"data: [DONE]\n\n"])
    assert error is None
    assert [(c["choices"][0]["delta"], c["choices"][0].get("logprobs")) for c in chunks[:-1]] == [
        ({"content": "!"}, leg[1]["choices"][0]["logprobs"]),
        ({}, None),
    ]


def test_each_choice_of_n_is_resumed_from_its_own_output():
    original = {"messages": [], "n": 3, "stream": True, "max_tokens": 4}
    relay = StreamRelay(StreamLog.of(original, chat=True), original)
    first = [role_chunk(prompt_token_ids=[1, 2])]
    first += [lp_chunk("a", [10], 0), lp_chunk("b", [20], 1), lp_chunk("c", [30], 2)]
    first += [lp_chunk("", [11], 0, finish_reason="stop"), lp_chunk("d", [21], 1)]
    first += [lp_chunk("e", [31], 2), lp_chunk("f", [32], 2), lp_chunk("g", [33], 2)]
    run(relay, [b"".join(sse(c) for c in first)])
    # Choice 2's budget is spent (its finish chunk was lost): it ends here, the others run.
    ends = [json.loads(e[6:]) for e in b"".join(relay.end_spent()).decode().split("\n\n") if e]
    assert [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in ends] == [
        (2, "length")
    ]
    assert relay.remaining() == 2
    assert relay.resume_body(2)["resume"]["choices"] == [
        {"output_token_ids": [10, 11], "finish_reason": "stop"},
        {"output_token_ids": [20, 21], "finish_reason": None},
        {"output_token_ids": [30, 31, 32, 33], "finish_reason": "length"},
    ]
    leg = [lp_chunk("h", [22], 1, prompt_token_ids=[1, 2])]
    leg.append(lp_chunk("", [23], 1, finish_reason="length"))
    chunks, error = run(relay, [b"".join(sse(c) for c in leg) + b"data: [DONE]\n\n"])
    assert error is None and [c["choices"][0]["index"] for c in chunks[:-1]] == [1, 1]
    assert relay.log.ended and relay.log.choices[1].settled == [20, 21, 22, 23]
