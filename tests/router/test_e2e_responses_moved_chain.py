"""End to end with real model workers: a response chain goes on where its migrated response
was stored, after the worker it started on is back (``router/response_homes.py``).

A streamed first turn starts on one worker, which is killed mid-stream once a second has
joined: the stream is resumed, and the response stored, on the second. The first comes back
at its URL with nothing stored. The next turn through the same router goes to the second
(remembered), and through a fresh router replica, which first asks the restarted worker
(answered 400 ``previous_response_not_found``), then the second; that replica remembers it
too. Every turn's text equals an undisturbed chain's, and is served from the KV the moved
turns left.

Slow (model processes on loopback): ``pytest -m slow tests/router``.
"""

from __future__ import annotations

import time

import openai
import pytest

from splitserve.router.proxy import DECODE_HEADER

from .conftest import HTTP, restart_real_worker, wait_until
from .test_e2e_responses_migration import (
    ADMIN_KEY,
    KILL_AFTER_DELTAS,
    MIGRATED,
    Stream,
    reply,
    request,
)
from .test_proxy import metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


BLOCK = 16


def healthy(router_url: str, url: str) -> bool:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    workers = HTTP.get(router_url + "/workers", headers=admin, timeout=5).json()["workers"]
    return any(w["url"] == url and w["healthy"] for w in workers)


def follow_up(router_url: str, previous: str, model: str, stream: bool = False):
    """The chain's next turn; the model is named (``models.list`` is a request the router
    places too, which would move round-robin's turn)."""
    client = openai.OpenAI(base_url=router_url + "/v1", api_key="unused", max_retries=0)
    raw = client.responses.with_raw_response.create(
        model=model,
        input="Now give the story a title.",
        previous_response_id=previous,
        max_output_tokens=16,
        temperature=0,
        stream=stream,
    )
    if not stream:
        return raw.headers[DECODE_HEADER], raw.parse()
    events = list(raw.parse())
    assert events[-1].type in ("response.completed", "response.incomplete"), events[-1]
    return raw.headers[DECODE_HEADER], events[-1].response


def cached(response) -> int:
    return response.usage.input_tokens_details.cached_tokens


def written(usage: dict) -> int:
    """The tokens of a turn's context held in whole KV blocks after it: its prompt and all
    but its last output token (never fed back), in 16-token blocks. A worker may hold more
    (another test's identical conversation), never less."""
    return BLOCK * ((usage["input_tokens"] + usage["output_tokens"] - 1) // BLOCK)


def test_a_chain_goes_on_where_its_migrated_response_was_stored(real_workers, make_router):
    # ``first`` sorts first by URL: the round-robin replica below asks it first.
    first, second = sorted(real_workers, key=lambda w: w.url)[:2]
    router = make_router(workers=[first.url], load_floor=64, admin_key=ADMIN_KEY)
    model = HTTP.get(router.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    clean = Stream(router.url, request("greedy")).result()
    clean_id = reply(clean)[2]["id"]
    _, clean_turn = follow_up(router.url, clean_id, model)
    _, clean_next = follow_up(router.url, clean_turn.id, model)
    _, clean_last = follow_up(router.url, clean_next.id, model)

    moving = Stream(router.url, request("greedy"))
    deadline = time.monotonic() + 120
    while moving.deltas < KILL_AFTER_DELTAS:
        assert moving.thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    r = HTTP.post(router.url + "/workers", json={"url": second.url}, headers=admin)
    assert r.status_code == 201, r.text
    first.kill()
    lines = moving.result()
    assert any(line.startswith(MIGRATED + " " + second.url) for line in lines)
    assert reply(lines)[0] == reply(clean)[0]
    moved = reply(lines)[2]

    back = restart_real_worker(first)
    wait_until(lambda: healthy(router.url, back.url), 30, "the router to see the worker back")

    # The same router remembers where the chain went.
    served, turn = follow_up(router.url, moved["id"], model)
    assert served == second.url
    assert turn.output_text == clean_turn.output_text
    # Every block of the moved turn's context is found where it was stored.
    assert cached(clean_turn) >= written(reply(clean)[2]["usage"]) > 0
    assert cached(turn) >= written(moved["usage"]) > 0

    # A replica that does not: round-robin asks the restarted worker first, then the second.
    replica = make_router(workers=[back.url, second.url], policy="round-robin", admin_key=ADMIN_KEY)
    wait_until(lambda: healthy(replica.url, back.url), 30, "the replica to see both workers")
    served, following = follow_up(replica.url, turn.id, model, stream=True)
    assert served == second.url
    assert metric(replica, "splitserve:router_response_searches_total") == 1
    assert following.output_text == clean_next.output_text
    assert cached(following) >= written(turn.usage.model_dump()) > 0
    # ... and remembers: the next turn goes to the second at once (round-robin's next pick
    # would be the restarted worker again).
    served, last = follow_up(replica.url, following.id, model)
    assert served == second.url
    assert metric(replica, "splitserve:router_response_searches_total") == 1
    assert last.output_text == clean_last.output_text
    assert cached(last) >= written(following.usage.model_dump()) > 0

    # A response no worker holds is still the worker's 400, once every worker was asked.
    r = HTTP.post(
        replica.url + "/v1/responses",
        json={"model": model, "input": "Hi.", "previous_response_id": clean_id},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"
    assert metric(replica, "splitserve:router_response_searches_total") == 2
