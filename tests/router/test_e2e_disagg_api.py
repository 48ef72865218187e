"""End to end with real model workers: grammars and ``n > 1`` through the remote prefill leg.

A router over a prefill and a decode worker runs every request's two legs (the prefill
worker computes the prompt with the request's grammar and one token, the decode worker pulls
its KV and runs the whole request); a router over one collocated worker is the reference.
Greedy (and seeded) replies are equal, streamed or not.

Slow (three model processes on loopback): ``pytest -m slow tests/router``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from procs import metric, start_worker, stop_group, wait_healthy
from tool_chat import forecast_tool

from splitserve.router.config import RouterConfig

from .conftest import HTTP, RouterServer
from .test_e2e_agent_migration import FLAG, FORECAST_TOOL, STORY, chunks, comparable
from .test_e2e_responses_migration import comparable as responses_comparable

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SECRET = "disagg-api-secret"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
FLAG_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "flag", "schema": FLAG, "strict": True},
}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "json_schema": (
        CHAT,
        {
            "messages": [{"role": "user", "content": "Describe a flag as JSON."}],
            "response_format": FLAG_FORMAT,
        },
    ),
    "tool_named": (
        CHAT,
        {
            "messages": [{"role": "user", "content": "What will the weather be in Lisbon?"}],
            "tools": [FORECAST_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_forecast"}},
        },
    ),
    "n_greedy": (CHAT, {"messages": STORY, "n": 3}),
    "n_seeded_json": (
        COMPLETIONS,
        {
            "prompt": "A JSON object that describes a flag:",
            "response_format": FLAG_FORMAT,
            "n": 2,
            "temperature": 0.8,
            "seed": 7,
        },
    ),
}


@pytest.fixture(scope="module")
def deployments() -> Iterator[tuple[RouterServer, RouterServer]]:
    """(a router over a prefill and a decode worker, a router over one collocated worker)."""
    env = {"SPLITSERVE_KV_SECRET": SECRET}
    procs = {
        role: start_worker(["--role", role, "--kv-cache-gb", "0.2"], env=env)
        for role in ("prefill", "decode", "both")
    }
    routers: list[RouterServer] = []
    try:
        for url, proc in procs.values():
            wait_healthy(url, proc)
        url = {role: u for role, (u, _) in procs.items()}
        secret = SECRET.encode()
        disagg = RouterConfig(
            prefill=[url["prefill"]],
            decode=[url["decode"]],
            disaggregate=True,
            remote_prefill_threshold=1,  # every request takes the remote prefill leg
            cluster_secret=secret,
        )
        collocated = RouterConfig(workers=[url["both"]], cluster_secret=secret)
        routers += [RouterServer(disagg), RouterServer(collocated)]
        yield routers[0], routers[1]
    finally:
        for router in routers:
            router.stop()
        for _, proc in procs.values():
            stop_group(proc)


def ask(router: RouterServer, case: str, stream: bool) -> Any:
    path, body = CASES[case]
    body = {"temperature": 0, **body, "max_tokens": 40, "stream": stream}
    if not stream:
        r = HTTP.post(router.url + path, json=body, timeout=300)
        assert r.status_code == 200, r.text
        answer = r.json()
        del answer["id"], answer["created"]
        answer.pop("kv_transfer_params", None)
        answer["usage"].pop("prompt_tokens_details", None)
        for choice in answer["choices"]:
            for call in choice.get("message", {}).get("tool_calls") or ():
                del call["id"]
        return answer
    body["stream_options"] = {"include_usage": True}
    with HTTP.stream("POST", router.url + path, json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        return comparable([line for line in r.iter_lines() if line])


def texts(answer: Any) -> list[str]:
    """Each choice's reply: its content, or its tool calls' arguments."""
    out = []
    for choice in answer["choices"]:
        message = choice.get("message")
        if message is None:
            out.append(choice["text"])
        elif message.get("tool_calls"):
            out.append(message["tool_calls"][0]["function"]["arguments"])
        else:
            out.append(message["content"])
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("case", list(CASES))
def test_two_legs_answer_as_collocated(deployments, case, stream):
    disagg, collocated = deployments
    legs = metric(disagg.url, 'splitserve:router_remote_prefills_total{outcome="ok"}')
    got, want = ask(disagg, case, stream), ask(collocated, case, stream)
    assert metric(disagg.url, 'splitserve:router_remote_prefills_total{outcome="ok"}') == legs + 1
    if stream:
        assert chunks(got)[-1]["usage"] == chunks(want)[-1]["usage"]
        for line in got:  # call ids differ: comparable blanks them
            assert '"error"' not in line
    elif case != "n_greedy":
        for reply in texts(got):  # what the masks are there for
            assert isinstance(json.loads(reply), dict), reply
    assert got == want


# ---- /v1/responses: a first turn takes the remote prefill leg, a chained one stays local ----

RESPONSES = "/v1/responses"
RESPONSE_CASES: dict[str, dict[str, Any]] = {
    "text": {
        "instructions": "You are a storyteller. Write vivid prose.",
        "input": [{"role": "user", "content": "Write a story about a lighthouse keeper."}],
    },
    "tool_named": {
        "input": "What will the weather be in Lisbon?",
        "tools": [forecast_tool(responses=True)],
        "tool_choice": {"type": "function", "name": "get_forecast"},
    },
}
REMOTE_OK = 'splitserve:router_remote_prefills_total{outcome="ok"}'
SKIPPED = 'splitserve:router_remote_prefills_total{outcome="skipped"}'


def respond(router: RouterServer, body: dict[str, Any], stream: bool) -> tuple[dict, list[str]]:
    """The final response object and the answer's lines, with what differs between two runs
    (ids, timestamps, cached tokens) blanked."""
    body = {"temperature": 0, "max_output_tokens": 32, **body, "stream": stream}
    if not stream:
        r = HTTP.post(router.url + RESPONSES, json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json(), responses_comparable([json.dumps(r.json())])
    with HTTP.stream("POST", router.url + RESPONSES, json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    return json.loads(lines[-1][6:])["response"], responses_comparable(lines)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("case", list(RESPONSE_CASES))
def test_a_first_response_takes_the_remote_leg_and_answers_as_collocated(deployments, case, stream):
    disagg, collocated = deployments
    legs = metric(disagg.url, REMOTE_OK)
    (got, got_lines), (want, want_lines) = (
        respond(router, RESPONSE_CASES[case], stream) for router in (disagg, collocated)
    )
    assert metric(disagg.url, REMOTE_OK) == legs + 1
    assert got_lines == want_lines
    assert "kv_transfer_params" not in got and got["output"]
    # The decode worker pulled the prompt's full blocks and computed only the rest.
    assert got["usage"]["input_tokens_details"]["cached_tokens"] > 0


def test_a_chained_response_stays_on_its_decode_worker(deployments):
    disagg, collocated = deployments
    answers = []
    for router in (disagg, collocated):
        first, _ = respond(router, RESPONSE_CASES["text"], False)
        legs, skipped = metric(disagg.url, REMOTE_OK), metric(disagg.url, SKIPPED)
        more = {
            "instructions": RESPONSE_CASES["text"]["instructions"],  # not carried over
            "input": "Now give it a title.",
            "previous_response_id": first["id"],
        }
        answers.append(respond(router, more, True))
        if router is disagg:  # its conversation is there, and mostly cached
            assert metric(disagg.url, REMOTE_OK) == legs
            assert metric(disagg.url, SKIPPED) == skipped + 1
            previous = first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
            cached = answers[-1][0]["usage"]["input_tokens_details"]["cached_tokens"]
            assert cached >= previous - 16  # all but the last partial block
    assert answers[0][1] == answers[1][1]
