"""Where moved response chains live (``router/response_homes.py``): the bounded memory, the
400 that starts a search, and the search's bound (each worker asked at most once)."""

from __future__ import annotations

import asyncio
import json

import pytest

from splitserve.router.replies import Buffered
from splitserve.router.response_homes import ChainHomes, previous_not_found, search
from splitserve.router.worker import Worker


def error(status: int, code: str) -> Buffered:
    body = {"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": code}}
    return Buffered(status, {}, json.dumps(body).encode())


NOT_FOUND = error(400, "previous_response_not_found")


def test_the_memory_forgets_the_least_recently_used_chain_first():
    homes = ChainHomes(capacity=2)
    homes.moved("a", "http://w1")
    homes.moved("b", "http://w2")
    assert homes.get("a") == "http://w1"  # a is now the most recently used
    homes.moved("c", "http://w3")
    assert (homes.get("a"), homes.get("b"), homes.get("c")) == ("http://w1", None, "http://w3")
    homes.moved("a", "http://w2")
    assert homes.get("a") == "http://w2" and len(homes) == 2
    assert homes.get(None) is None
    with pytest.raises(ValueError):
        ChainHomes(capacity=0)


def test_only_the_previous_response_400_starts_a_search():
    assert previous_not_found(NOT_FOUND)
    assert not previous_not_found(error(400, "invalid_value"))
    assert not previous_not_found(error(404, "previous_response_not_found"))
    assert not previous_not_found(Buffered(400, {}, b"not json"))
    assert not previous_not_found(Buffered(400, {}, b"[1]"))
    assert not previous_not_found(Buffered(200, {}, b"{}"))


def run_search(workers: list[str], holder: str | None) -> tuple[Buffered, list[str]]:
    """The search's answer over ``workers`` (picked in order) when ``holder`` has the
    response, and the workers it asked."""
    left, asked = list(workers), []

    async def attempt(worker: str) -> Buffered:
        asked.append(worker)
        return Buffered(200, {}, b"{}") if worker == holder else NOT_FOUND

    answer = asyncio.run(search(NOT_FOUND, lambda: left.pop(0) if left else None, attempt))
    return answer, asked


def test_the_search_asks_each_worker_once_and_stops_at_the_first_other_answer():
    answer, asked = run_search(["w2", "w3"], "w2")
    assert answer.status == 200 and asked == ["w2"]
    answer, asked = run_search(["w2", "w3"], None)
    assert answer is NOT_FOUND and asked == ["w2", "w3"]
    answer, asked = run_search([], None)  # no other worker: the 400 stands
    assert answer is NOT_FOUND and asked == []


def test_a_remembered_chain_is_placed_on_its_worker_only_while_it_is_a_candidate():
    homes = ChainHomes()
    w1, w2 = Worker("http://127.0.0.1:9001"), Worker("http://127.0.0.1:9002")
    assert homes.placed("c", [w1, w2]) is None  # not remembered: the policy places it
    homes.moved("c", w2.url)
    decision = homes.placed("c", [w1, w2])
    assert decision is not None and decision.decode is w2
    assert not decision.remote_prefill and decision.prefill is None and decision.peer is None
    assert homes.placed("c", [w1]) is None  # down or excluded: the policy places it
