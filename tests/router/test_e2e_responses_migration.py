"""End to end with real model workers: streamed ``/v1/responses`` survive a killed worker.

A resumed leg is the client's request again with the router's ``resume`` field
(``router/responses_relay.py``, ``worker/responses_api.py``). First the worker alone: a
response resumed from the router's log of a stream cut after any of its steps streams
exactly the events the undisturbed stream sent after them. Then through the router: every
case streams at once on one worker (raw, and through the official ``openai`` client), which
is killed mid-stream once a second worker has joined; each stream equals an undisturbed
run's but for ids, timestamps and cached tokens, the migrated response is stored and its
chain goes on, and a turn that continues a chain held by the dead worker ends with an
``error`` event.

Slow (model processes on loopback): ``pytest -m slow tests/router``.
"""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any

import openai
import pytest
from tool_chat import forecast_tool

from splitserve.common.responses_api import CHAIN_HEADER
from splitserve.router.proxy import DECODE_HEADER
from splitserve.router.responses_relay import ResponsesLog, ResponsesRelay

from .conftest import HTTP
from .test_proxy import metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MIGRATED = ": splitserve migrated to"
ADMIN_KEY = "admin-key"  # the membership endpoints need one
KILL_AFTER_DELTAS = 8  # every text stream has had this many text deltas when its worker dies
MAX_OUTPUT_TOKENS = 48
FORECAST_TOOL = forecast_tool(responses=True)  # the mask decides its arguments
STORY = "Write a long story about a lighthouse keeper and the storms he has seen."
CASES: dict[str, dict[str, Any]] = {
    "greedy": {"input": STORY, "temperature": 0},
    "seeded": {"input": STORY, "temperature": 0.9, "top_p": 0.95, "seed": 11},
    "tool_seeded": {  # a call of the named tool, its arguments sampled within the schema
        "input": "What will the weather be in Lisbon?",
        "tools": [FORECAST_TOOL],
        "tool_choice": {"type": "function", "name": "get_forecast"},
        "temperature": 0.8,
        "seed": 7,
    },
}
THROUGH_OPENAI = ("seeded", "tool_seeded")  # also streamed by the official client


def request(case: str, **more: Any) -> dict[str, Any]:
    return {**CASES[case], "max_output_tokens": MAX_OUTPUT_TOKENS, "stream": True, **more}


def stream_lines(url: str, body: dict, headers: dict | None = None) -> list[str]:
    with HTTP.stream("POST", url + "/v1/responses", json=body, headers=headers, timeout=300) as r:
        assert r.status_code == 200, r.read()
        return [line for line in r.iter_lines() if line]


def data(lines: list[str]) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def events(lines: list[str]) -> list[bytes]:
    """The stream's SSE events as raw bytes (comments dropped)."""
    out, current = [], []
    for line in lines:
        if line.startswith(":"):
            continue
        current.append(line)
        if line.startswith("data: "):
            out.append(("\n".join(current) + "\n\n").encode())
            current = []
    return out


_VARYING = [
    (re.compile(r'"(resp|msg|fc|call)_[0-9a-f]+"'), r'"\1_ID"'),
    (re.compile(r'"created_at": ?\d+'), '"created_at": 0'),
    (re.compile(r'"(cached_tokens|cache_write_tokens)": ?\d+'), r'"\1": 0'),
]


def comparable(lines: list[str]) -> list[str]:
    """The stream's lines with what differs between two runs of one request (ids, the
    creation time, cached tokens) blanked; comments and token-id events dropped."""
    out = []
    for line in lines:
        if line.startswith(":") or "splitserve.token_ids" in line:
            continue
        for pattern, blank in _VARYING:
            line = pattern.sub(blank, line)
        out.append(line)
    return out


def reply(lines: list[str]) -> tuple[str, list[str], dict]:
    """(text deltas joined, function-call arguments, the final response object)."""
    d = data(lines)
    text = "".join(e["delta"] for e in d if e["type"] == "response.output_text.delta")
    args = [e["arguments"] for e in d if e["type"] == "response.function_call_arguments.done"]
    return text, args, d[-1].get("response", {})


def check_consistent(lines: list[str]) -> None:
    """One response and one message item throughout, numbered 0, 1, 2, ... with no gap."""
    d = data(lines)
    assert [e["sequence_number"] for e in d] == list(range(len(d)))
    assert len({e["response"]["id"] for e in d if "response" in e}) == 1
    messages = {e["item"]["id"] for e in d if e.get("item", {}).get("type") == "message"}
    texts = {e["item_id"] for e in d if e["type"].startswith("response.output_text")}
    assert len(messages) <= 1 and texts <= messages


def check_reply(case: str, lines: list[str]) -> None:
    """The undisturbed reply does what the case is there for."""
    text, args, response = reply(lines)
    if case.startswith("tool"):
        assert response["status"] == "completed" and not text and len(args) == 1, lines
        assert json.loads(args[0])["city"].endswith("Portugal")
    else:
        assert response["status"] == "incomplete" and len(text) > 100, text


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_response_streams_what_the_undisturbed_one_sent_after_its_output(
    real_workers, case
):
    url = real_workers[0].url
    headers = {CHAIN_HEADER: "c" * 32}  # the router names the chain; resumes keep it
    body = request(case, return_token_ids=True)
    whole = stream_lines(url, body, headers)
    check_reply(case, whole)
    raw = events(whole)
    steps = [i for i, e in enumerate(raw) if b"splitserve.token_ids" in e][1:]  # 1 per token
    assert len(steps) >= 8
    for k in (1, len(steps) // 2, len(steps) - 1):  # cut after the k-th token's step
        relay = ResponsesRelay(ResponsesLog.of(body, None), body)
        for e in raw[: steps[k]]:
            relay.feed(e)
        assert relay.log.resumable
        resumed = relay.resume_body(relay.remaining())
        if case.startswith("tool"):  # the call is held back whole: its tokens replayed too
            assert relay.log.settled == [] and relay.log.message_id is None
            output = [json.loads(e.split(b"data: ")[1]) for e in raw[: steps[k]]]
            resumed["resume"]["output_token_ids"] = [
                t for e in output for t in e.get("token_ids", [])
            ]
        got = stream_lines(url, resumed, headers)
        want = [line for e in raw[steps[k] :] for line in e.decode().strip().split("\n")]
        assert comparable(got) == comparable(want), k


class Stream:
    """One streamed response through the router, read on a thread: raw lines, or with the
    official client (``client``) its parsed events, as JSON lines."""

    def __init__(self, router_url: str, body: dict, client: openai.OpenAI | None = None):
        self.body, self.url, self.client = body, router_url, client
        self.lines: list[str] = []
        self.worker = ""
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            if self.client is not None:
                self._run_client()
                return
            with HTTP.stream("POST", self.url + "/v1/responses", json=self.body, timeout=300) as r:
                assert r.status_code == 200, r.read()
                self.worker = r.headers[DECODE_HEADER]
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
        except BaseException as e:  # reported by ``result``
            self.error = e

    def _run_client(self) -> None:
        assert self.client is not None
        body = dict(self.body)
        extra = {k: body.pop(k) for k in ("seed",) if k in body}
        model = self.client.models.list().data[0].id
        for event in self.client.responses.create(model=model, extra_body=extra, **body):
            self.lines.append("data: " + event.model_dump_json(exclude_unset=True))

    @property
    def deltas(self) -> int:
        return sum('"response.output_text.delta"' in line for line in self.lines)

    def result(self) -> list[str]:
        self.thread.join(timeout=600)
        assert not self.thread.is_alive() and self.error is None, repr(self.error)
        return self.lines


def run_all(
    router_url: str, kill=None, join=None, extra: dict | None = None
) -> dict[tuple[str, bool], Stream]:
    """Every case at once (raw, and through the client for ``THROUGH_OPENAI``), and ``extra``
    raw; with ``kill``, once every text stream has had ``KILL_AFTER_DELTAS`` deltas, ``join``
    joins the router and ``kill`` (the worker serving them all) is SIGKILLed."""
    client = openai.OpenAI(base_url=router_url + "/v1", api_key="unused", max_retries=0)
    streams = {(c, False): Stream(router_url, request(c)) for c in CASES}
    streams |= {(c, True): Stream(router_url, request(c), client) for c in THROUGH_OPENAI}
    for name, body in (extra or {}).items():
        streams[(name, False)] = Stream(router_url, body)
    if kill is not None:
        text = [s for key, s in streams.items() if not key[0].startswith("tool")]
        deadline = time.monotonic() + 120
        while not all(s.deltas >= KILL_AFTER_DELTAS for s in text):
            assert all(s.thread.is_alive() for s in streams.values()), "a stream ended early"
            assert time.monotonic() < deadline, "the streams did not get going"
            time.sleep(0.01)
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        r = HTTP.post(router_url + "/workers", json={"url": join.url}, headers=admin)
        assert r.status_code == 201, r.text
        kill.kill()
    for s in streams.values():
        s.result()
    return streams


def follow_up(router_url: str, previous: str) -> openai.types.responses.Response:
    client = openai.OpenAI(base_url=router_url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    return client.responses.with_raw_response.create(
        model=model,
        input="Now give the story a title.",
        previous_response_id=previous,
        max_output_tokens=16,
        temperature=0,
    )


def test_response_streams_survive_a_killed_worker(real_workers, make_router):
    first, second = real_workers[:2]
    # One worker at first, so that every chain (keyed by its own id) starts there.
    router = make_router(workers=[first.url], load_floor=64, admin_key=ADMIN_KEY)
    clean = run_all(router.url)
    for (case, _), s in clean.items():
        check_reply(case, s.lines)
    greedy_id = reply(clean[("greedy", False)].lines)[2]["id"]
    clean_title = follow_up(router.url, greedy_id).parse().output_text
    # A turn continuing a chain held by the worker that will die cannot move.
    chained = request("greedy", previous_response_id=greedy_id, input="Tell me more.")

    disturbed = run_all(router.url, first, second, {"chained": chained})

    for key, s in disturbed.items():
        if key[0] == "chained":
            continue
        check_consistent(s.lines)
        if key[1]:  # parsed by the official client: the same events, the same reply
            assert comparable(s.lines) == comparable(clean[key].lines), key
            assert reply(s.lines)[:2] == reply(clean[key].lines)[:2], key
            continue
        assert comparable(s.lines) == comparable(clean[key].lines), key
        moved = [i for i, line in enumerate(s.lines) if line.startswith(MIGRATED)]
        assert moved and second.url in s.lines[moved[0]], key  # it was live when first died
        if not key[0].startswith("tool"):  # it was mid-way: text came before and after
            assert reply(s.lines[: moved[0]])[0] and reply(s.lines[moved[0] :])[0], key

    # The chained turn ends with an error event that says why, numbered after the rest.
    lines = disturbed[("chained", False)].lines
    check_consistent(lines)
    last = data(lines)[-1]
    assert last["type"] == "error" and last["code"] == "worker_failed", last
    assert "chain" in last["message"]
    assert metric(router, "splitserve:router_migrations_total") == len(CASES) + len(THROUGH_OPENAI)

    # The migrated response was stored where it finished, and its chain goes on there.
    streamed = reply(disturbed[("greedy", False)].lines)[2]
    r = HTTP.get(router.url + f"/v1/responses/{streamed['id']}", timeout=30)
    assert r.status_code == 200 and r.json() == streamed
    raw = follow_up(router.url, streamed["id"])
    assert raw.headers[DECODE_HEADER] == second.url
    assert raw.parse().output_text == clean_title
