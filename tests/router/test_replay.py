"""Replaying a stream on vLLM workers (``ResumeMode.REPLAY``): which chunks of the replayed leg
the client already has, alone, then through the router on fake workers."""

from __future__ import annotations

import json

import pytest

from splitserve.router.migration import StreamLog, StreamRelay
from splitserve.router.proxy import DECODE_HEADER
from splitserve.router.replay import ReplayDiverged
from splitserve.router.resume_mode import ResumeMode

from .conftest import HTTP
from .test_migration import chat_chunk, lp_chunk, role_chunk, run, sse
from .test_proxy import metric, urls

pytestmark = pytest.mark.timeout(120)
HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m"}


def replay_relay(original: dict, first: list[dict]) -> StreamRelay:
    """A replaying relay that relayed ``first`` (its first leg, cut there) to its client."""
    relay = StreamRelay(StreamLog.of(original, chat=True), original, ResumeMode.REPLAY)
    run(relay, [b"".join(sse(c) for c in first)])
    return relay


def replayed(*chunks: dict) -> bytes:
    """A replayed leg from another worker: its own id and created; ends with [DONE]."""
    leg = b"".join(sse(c | {"id": "chatcmpl-2", "created": 9}) for c in chunks)
    return leg + b"data: [DONE]\n\n"


def test_a_replayed_leg_skips_what_the_client_has_held_back_text_included():
    original = {"messages": [], "seed": 3, "max_tokens": 5, "stream": True}
    # Token 51's text is held back: its chunk went to no client, but it counts as sent.
    first = [role_chunk(prompt_token_ids=[1, 2]), chat_chunk("Hi", [50]), chat_chunk("", [51])]
    relay = replay_relay(original, first)
    assert relay.resume_path == "/v1/chat/completions"
    assert relay.resume_body(relay.remaining()) == original | {"return_token_ids": True}
    assert relay.remaining() == 3  # 50 and 51 are not generated again
    leg = [role_chunk(prompt_token_ids=[1, 2]), chat_chunk("Hi", [50]), chat_chunk("", [51])]
    leg += [chat_chunk(" there", [52]), chat_chunk("!", [53], finish_reason="stop")]
    chunks, error = run(relay, [replayed(*leg)])
    assert error is None and chunks[-1] == "DONE"
    assert chunks[:-1] == [  # as the first leg would have gone on: its id and created
        HEAD | {"choices": [{"index": 0, "delta": {"content": " there"}, "finish_reason": None}]},
        HEAD | {"choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": "stop"}]},
    ]
    c = relay.log.choices[0]
    assert c.settled == [50, 51, 52, 53] and c.finish_reason == "stop"


def test_a_replayed_leg_that_chose_another_token_diverges():
    original = {"messages": [], "seed": 3, "stream": True}
    relay = replay_relay(original, [role_chunk(prompt_token_ids=[1]), chat_chunk("a", [50])])
    relay.resume_body(10)
    with pytest.raises(ReplayDiverged, match="other tokens"):
        run(relay, [replayed(role_chunk(prompt_token_ids=[1]), chat_chunk("b", [60]))])


def test_a_replayed_chunk_across_the_resume_point_is_cut_where_the_clients_text_ends():
    # vLLM bunches tokens in one chunk when its reader lags. The client has 50 and 51, whose
    # text ("ab") came in other chunks than the replay's.
    original = {"messages": [], "seed": 3, "logprobs": True, "stream": True}
    first = [role_chunk(prompt_token_ids=[1]), lp_chunk("a", [50]), lp_chunk("b", [51])]
    relay = replay_relay(original, first)
    relay.resume_body(10)
    leg = [role_chunk(prompt_token_ids=[1]), lp_chunk("", [50]), lp_chunk("abc", [51, 52])]
    leg.append(lp_chunk("d", [53]))
    chunks, _ = run(relay, [replayed(*leg)])
    sent = [(c["choices"][0]["delta"], c["choices"][0]["logprobs"]["content"]) for c in chunks[:-1]]
    assert [(delta, [t["token"] for t in lp]) for delta, lp in sent] == [
        ({"content": "c"}, ["t52"]),
        ({"content": "d"}, ["t53"]),
    ]
    assert relay.log.choices[0].settled == [50, 51, 52, 53]


def test_a_replayed_call_across_the_resume_point_is_cut_in_its_arguments():
    original = {"messages": [], "tools": [{"type": "function"}], "stream": True}
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f"}}
    first = [role_chunk(prompt_token_ids=[1]), chat_chunk(None, [50]), chat_chunk(None, [51])]
    first[1]["choices"][0]["delta"] = {
        "tool_calls": [call | {"function": {"name": "f", "arguments": '{"'}}]
    }
    first[2]["choices"][0]["delta"] = {"tool_calls": [{"index": 0, "function": {"arguments": "x"}}]}
    relay = replay_relay(original, first)
    relay.resume_body(10)
    leg = [role_chunk(prompt_token_ids=[1]), first[1], chat_chunk(None, [51, 52])]
    leg[2]["choices"][0]["delta"] = {
        "tool_calls": [{"index": 0, "function": {"arguments": 'x": 1}'}}]
    }
    chunks, error = run(relay, [replayed(*leg)])
    assert error is None
    assert chunks[0]["choices"][0]["delta"] == {
        "tool_calls": [{"index": 0, "function": {"arguments": '": 1}'}}]
    }


@pytest.mark.parametrize(
    "delta",
    [
        {"content": "bc", "tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]},
        {"tool_calls": [{"index": 0, "id": "call_2", "function": {"name": "g", "arguments": "{"}}]},
    ],
)
def test_a_replayed_chunk_across_the_resume_point_that_cannot_be_cut_diverges(delta):
    original = {"messages": [], "tools": [{"type": "function"}], "stream": True}
    first = [role_chunk(prompt_token_ids=[1]), chat_chunk("a", [50]), chat_chunk("b", [51])]
    relay = replay_relay(original, first)
    relay.resume_body(10)
    across = chat_chunk(None, [51, 52])
    across["choices"][0]["delta"] = delta
    with pytest.raises(ReplayDiverged, match="cannot be cut"):
        run(relay, [replayed(role_chunk(prompt_token_ids=[1]), chat_chunk("a", [50]), across)])


def test_a_replayed_stream_that_ends_before_the_resume_point_diverges():
    original = {"messages": [], "seed": 3, "stream": True}
    first = [role_chunk(prompt_token_ids=[1]), chat_chunk("a", [50]), chat_chunk("b", [51])]
    relay = replay_relay(original, first)
    relay.resume_body(10)
    with pytest.raises(ReplayDiverged, match="ended after 1 of 2"):
        run(relay, [replayed(chat_chunk("a", [50]), chat_chunk(None, None, finish_reason="stop"))])


def test_each_replayed_choice_skips_its_own_tokens_and_an_ended_one_is_not_sent_again():
    original = {"messages": [], "n": 2, "seed": 1, "logprobs": True, "stream": True}
    first = [role_chunk(prompt_token_ids=[1]), role_chunk() | {"choices": [{"index": 1}]}]
    first[1]["choices"][0] |= {"delta": {"role": "assistant", "content": ""}}
    first += [lp_chunk("a", [10], 0), lp_chunk("b", [20], 1)]
    first += [lp_chunk("c", [11], 0, finish_reason="stop"), lp_chunk("d", [21], 1)]
    relay = replay_relay(original, first)
    relay.resume_body(relay.remaining())
    leg = [role_chunk(prompt_token_ids=[1]), first[1]]
    leg += [lp_chunk("a", [10], 0), lp_chunk("b", [20], 1), lp_chunk("c", [11], 0)]
    leg += [lp_chunk("d", [21], 1), lp_chunk("e", [22], 1), lp_chunk("", [23], 1)]
    leg += [lp_chunk("f", [24], 1, finish_reason="length")]
    chunks, error = run(relay, [replayed(*leg)])
    assert error is None
    sent = [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in chunks[:-1]]
    assert sent == [(1, {"content": "e"}), (1, {"content": ""}), (1, {"content": "f"})]
    tokens = [t["token"] for c in chunks[:-1] for t in c["choices"][0]["logprobs"]["content"]]
    assert tokens == ["t22", "t23", "t24"]  # each token's log-probabilities once
    assert [c.settled for c in relay.log.choices] == [[10, 11], [20, 21, 22, 23, 24]]


def test_a_second_failure_replays_again_from_what_the_client_has_by_then():
    original = {"messages": [], "seed": 3, "stream": True}
    relay = replay_relay(original, [role_chunk(prompt_token_ids=[1]), chat_chunk("a", [50])])
    relay.resume_body(10)
    chunks, _ = run(relay, [sse(chat_chunk("a", [50])) + sse(chat_chunk("b", [51]))])
    assert chunks[0]["choices"][0]["delta"] == {"content": "b"}
    relay.resume_body(10)
    leg = [chat_chunk("a", [50]), chat_chunk("b", [51]), chat_chunk("c", [52])]
    chunks, _ = run(relay, [replayed(*leg)])
    assert [c["choices"][0]["delta"] for c in chunks[:-1]] == [{"content": "c"}]


def stream_events(router, body: dict) -> tuple[str, list[str]]:
    """(decode worker header, client events) of one streamed chat request."""
    with HTTP.stream(
        "POST",
        router.url + "/v1/chat/completions",
        json=body,
        headers={"X-Session-Id": "replay"},
        timeout=30.0,
    ) as r:
        assert r.status_code == 200
        return r.headers[DECODE_HEADER], [line for line in r.iter_lines() if line]


@pytest.mark.parametrize("diverges", [False, True])
def test_a_vllm_stream_is_replayed_on_the_next_worker(workers3, make_router, diverges):
    router = make_router(workers=urls(workers3), health_interval_s=60, worker_engine="vllm")
    for w in workers3:
        w.mode(greedy=True)
    messages = [{"role": "user", "content": "abc"}]
    body = {"messages": messages, "stream": True, "max_tokens": 8, "seed": 5}
    home_url, clean = stream_events(router, body)
    home = next(w for w in workers3 if w.url == home_url)
    home.mode(mode="die_midstream", die_after=3)  # after tokens 3 4 5 (the prompt is 97 98 99)
    for w in workers3:
        if w is not home and diverges:
            w.mode(diverge_at=5)  # the replay picks another third token
    seen_before = {w.url: len(w.seen()) for w in workers3}
    _, events = stream_events(router, body)
    assert any(e.startswith(": splitserve migrated to") and "(replay)" in e for e in events)
    [resumed] = [r for w in workers3 if w is not home for r in w.seen()[seen_before[w.url] :]]
    assert resumed["body"] == body | {"return_token_ids": True}  # the request itself again
    data = [e for e in events if not e.startswith(":")]
    if not diverges:
        assert data == clean  # one stream, as the undisturbed one
        assert metric(router, "splitserve:router_replay_divergences_total") == 0
        return
    error = json.loads(data[-1][6:])["error"]
    assert error["code"] == "worker_failed" and "no worker could resume it" in error["message"]
    assert data[:-1] == clean[:3]  # what the client had, then the error: nothing else
    assert metric(router, "splitserve:router_replay_divergences_total") == 1
