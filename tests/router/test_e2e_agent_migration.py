"""End to end with real model workers: agent streams (tools, structured output, seeded
sampling, penalties, log-probabilities) survive a killed worker, byte for byte.

A resumed leg on a builtin worker is the client's request again with the router's ``resume``
field (``router/migration.py``, ``worker/resume.py``). First the worker alone: a request
resumed after any number of its output tokens streams exactly the chunks the undisturbed
stream sent after them. Then through the router: every case streams at once on one worker,
which is killed mid-stream, and each client's stream equals an undisturbed run's but for ids
and timestamps.

Slow (three model processes on loopback): ``pytest -m slow tests/router``.
"""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any

import pytest
from tool_chat import WEATHER_TOOL, few_shot_tool_calls, forecast_tool

from splitserve.router.proxy import DECODE_HEADER

from .conftest import HTTP
from .test_proxy import metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MIGRATED = ": splitserve migrated to"
KILL_AFTER_TOKENS = 8  # every stream has streamed this many token ids when its worker dies
FORECAST_TOOL = forecast_tool()
FLAG = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "colours", "count"],
}
STORY = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
LONG = {"ignore_eos": True}  # every stream is still going when its worker is killed
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "tools_auto": (
        CHAT,
        {"messages": few_shot_tool_calls("Lisbon"), "tools": [WEATHER_TOOL], "temperature": 0},
    ),
    "tool_named": (
        CHAT,
        {
            "messages": [{"role": "user", "content": "What will the weather be in Lisbon?"}],
            "tools": [FORECAST_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_forecast"}},
            "temperature": 0,
        },
    ),
    "json_schema": (
        CHAT,
        {
            "messages": [{"role": "user", "content": "Describe a flag as JSON."}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "flag", "schema": FLAG, "strict": True},
            },
            "temperature": 0,
        },
    ),
    "seeded": (
        CHAT,
        {"messages": STORY, "temperature": 0.9, "top_p": 0.95, "seed": 11, "ignore_eos": True},
    ),
    "penalties": (
        CHAT,
        {
            "messages": STORY,
            "temperature": 0,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.7,
            "repetition_penalty": 1.3,
            "ignore_eos": True,
        },
    ),
    "logprobs": (  # the log-probabilities of the resumed part too (LOGPROB_TOL)
        CHAT,
        {"messages": STORY, "temperature": 0, "logprobs": True, "top_logprobs": 3, **LONG},
    ),
    "completion_logprobs": (
        COMPLETIONS,
        {
            "prompt": "Once upon a time, a lighthouse keeper",
            "temperature": 0,
            "logprobs": 2,
            **LONG,
        },
    ),
    "completion_json_seeded": (
        COMPLETIONS,
        {
            "prompt": "A JSON object that describes a flag:",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "flag", "schema": FLAG},
            },
            "temperature": 0.8,
            "seed": 3,
        },
    ),
}


def request(case: str, ids: bool, cases: dict = CASES) -> tuple[str, dict[str, Any]]:
    path, body = cases[case]
    more = {"return_token_ids": True} if ids else {}
    options = {"include_usage": True}
    return path, {**body, "max_tokens": 48, "stream": True, "stream_options": options, **more}


def stream_lines(url: str, path: str, body: dict, headers: dict | None = None) -> list[str]:
    with HTTP.stream("POST", url + path, json=body, headers=headers, timeout=300) as r:
        assert r.status_code == 200, r.read()
        return [line for line in r.iter_lines() if line]


def chunks(lines: list[str]) -> list[dict]:
    return [json.loads(x[6:]) for x in lines if x.startswith("data: {")]


def token_chunks(lines: list[str]) -> int:
    return sum(1 for c in chunks(lines) if c["choices"] and c["choices"][0].get("token_ids"))


_VARYING = [
    (re.compile(r'"id":"(chatcmpl|cmpl)-[0-9a-f]+"'), '"id":"ID"'),
    (re.compile(r'"created":\d+'), '"created":0'),
    (re.compile(r'"id":"call_[0-9a-f]+"'), '"id":"CALL"'),
    (re.compile(r'"cached_tokens":\d+'), '"cached_tokens":0'),
]


def comparable(lines: list[str]) -> list[str]:
    """The stream's SSE data lines with what differs between two runs of one request
    (response and tool-call ids, timestamps, cached tokens) blanked; comments dropped."""
    out = []
    for line in lines:
        if line.startswith(":"):
            continue
        for pattern, blank in _VARYING:
            line = pattern.sub(blank, line)
        out.append(line)
    return out


# The float32 engine (the tests') rounds a token's logits differently in a prefill (a resumed
# leg's) and in decode steps of batches of different sizes (a disturbed run batches
# differently): log-probabilities are equal within this. (bfloat16 on CPU: bit for bit.)
LOGPROB_TOL = 1e-4


def same(got: list[str], want: list[str]) -> bool:
    """Equal comparable lines, but for floats (log-probabilities) within ``LOGPROB_TOL``."""
    return len(got) == len(want) and all(
        a == b or (a.startswith("data: {") and _close(json.loads(a[6:]), json.loads(b[6:])))
        for a, b in zip(got, want, strict=True)
    )


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= LOGPROB_TOL
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def reply_of(lines: list[str]) -> tuple[str, list[dict], str]:
    """(content, tool calls, finish reason) of a streamed chat reply."""
    choices = [c["choices"][0] for c in chunks(lines) if c["choices"]]
    text = "".join(ch.get("delta", {}).get("content") or ch.get("text") or "" for ch in choices)
    calls = [tc for ch in choices for tc in ch.get("delta", {}).get("tool_calls", [])]
    return text, calls, choices[-1]["finish_reason"]


def check_reply(case: str, lines: list[str]) -> None:
    """The undisturbed reply does what the case is there for."""
    text, calls, finish = reply_of(lines)
    if case in ("tools_auto", "tool_named"):
        assert finish == "tool_calls" and len(calls) == 1 and not text, lines
        args = json.loads(calls[0]["function"]["arguments"])
        assert case != "tool_named" or args["city"].endswith("Portugal")
    elif case in ("json_schema", "completion_json_seeded"):
        assert finish == "stop" and isinstance(json.loads(text), dict), text
    else:
        assert finish == "length" and len(text) > 50


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_request_streams_what_the_undisturbed_one_sent_after_its_output(
    real_workers, case
):
    url = real_workers[0].url
    path, body = request(case, ids=True)
    whole = stream_lines(url, path, body)
    check_reply(case, whole)
    data = chunks(whole)
    prompt = data[0]["prompt_token_ids"]
    per_token = [c for c in data if c["choices"] and c["choices"][0].get("token_ids")]
    output = [t for c in per_token for t in c["choices"][0]["token_ids"]]
    assert len(output) == len(per_token) >= 8  # one chunk per token
    lead = 1 if path == CHAT else 0  # the role chunk
    for k in (1, len(output) // 2, len(output) - 1):
        resume = {"prompt_token_ids": prompt, "output_token_ids": output[:k]}
        resumed = stream_lines(url, path, {**body, "resume": resume})
        first = chunks(resumed)[0]
        assert first.pop("prompt_token_ids") == prompt  # the router strips it
        rest = [json.dumps(first, ensure_ascii=False, separators=(",", ":"))]
        expected = comparable(whole[lead + k :])
        assert same(comparable([f"data: {rest[0]}", *resumed[1:]]), expected), k


class Stream:
    """One streamed request through the router, read on a thread."""

    def __init__(self, router_url: str, case: str, ids: bool, cases: dict = CASES) -> None:
        self.case, self.ids = case, ids
        self.path, self.body = request(case, ids, cases)
        self.url = router_url
        self.lines: list[str] = []
        self.worker = ""
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        headers = {"X-Session-Id": "agent"}  # every stream on one worker
        try:
            with HTTP.stream(
                "POST", self.url + self.path, json=self.body, headers=headers, timeout=300
            ) as r:
                assert r.status_code == 200, r.read()
                self.worker = r.headers[DECODE_HEADER]
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
        except BaseException as e:  # reported by ``result``
            self.error = e

    def result(self) -> list[str]:
        self.thread.join(timeout=600)
        assert not self.thread.is_alive() and self.error is None, repr(self.error)
        assert self.lines[-1] == "data: [DONE]" and all(
            "error" not in c for c in chunks(self.lines)
        )
        return self.lines


def run_all(router_url: str, workers=None, cases: dict = CASES) -> dict[tuple[str, bool], Stream]:
    """Every case at once, with and without token ids; with ``workers``, SIGKILL the one
    serving them once every stream with ids has streamed ``KILL_AFTER_TOKENS`` of them (in
    each of its choices)."""
    streams = {(c, ids): Stream(router_url, c, ids, cases) for c in cases for ids in (True, False)}
    if workers is not None:
        with_ids = [s for s in streams.values() if s.ids]
        deadline = time.monotonic() + 120

        def going(s: Stream) -> bool:
            return token_chunks(s.lines) >= KILL_AFTER_TOKENS * s.body.get("n", 1)

        while not all(going(s) for s in with_ids):
            assert all(s.thread.is_alive() for s in with_ids), "a stream ended before the kill"
            assert time.monotonic() < deadline, "the streams did not get going"
            time.sleep(0.01)
        [victim] = {s.worker for s in streams.values()}
        next(w for w in workers if w.url == victim).kill()
    for s in streams.values():
        s.result()
    return streams


def test_agent_streams_survive_a_killed_worker_byte_for_byte(real_workers, make_router):
    # load_floor: bounded loads never move a stream off the session's worker.
    router = make_router(workers=[w.url for w in real_workers], load_floor=64)
    clean = run_all(router.url)
    for (case, _), s in clean.items():
        check_reply(case, s.lines)

    disturbed = run_all(router.url, real_workers)

    for key, s in disturbed.items():
        lines = s.lines
        assert same(comparable(lines), comparable(clean[key].lines)), key
        moved = [i for i, line in enumerate(lines) if line.startswith(MIGRATED)]
        assert len(moved) == 1, key  # it was live when its worker died
        before = lines[: moved[0]]  # and it was mid-way: part of it came before, its end after
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks(before) if c["choices"])
        if s.ids:
            assert token_chunks(before) >= KILL_AFTER_TOKENS, key
        elif "tool" not in key[0]:  # (a call is held back whole)
            assert reply_of(before)[0], key
    assert metric(router, "splitserve:router_migrations_total") == len(disturbed)
