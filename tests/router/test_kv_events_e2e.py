"""End to end: two builtin workers publish KV events, a router places by them.

The router tokenizes each chat request itself; its ids must be the worker's (the worker
returns them with ``return_token_ids``), its index must predict the cached prefix each
worker then reports (``usage.prompt_tokens_details.cached_tokens``), and a conversation's
turns must follow the worker holding its prefix even though every turn names a new
session key (the session ring alone would scatter them).
"""

from __future__ import annotations

import time
import uuid

import pytest
from procs import free_port, start_worker, stop_group, wait_healthy

from splitserve.common.kv_hash import hash_blocks
from splitserve.router.kv_index import ROOT, KVIndex, chain_root
from splitserve.router.prompt_tokens import ChatTokenizer
from splitserve.router.proxy import DECODE_HEADER, PREDICTED_HEADER

from .conftest import HTTP, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BS = 16  # the workers' default block size


@pytest.fixture(scope="module")
def workers():
    """Two workers publishing KV events and answering replays: ``[(url, source), ...]``,
    ``source`` as the router takes it (``ENDPOINT,REPLAY``)."""
    started = []
    try:
        for _ in range(2):
            endpoint, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
            args = ["--kv-cache-gb", "0.2", "--kv-events-endpoint", endpoint]
            url, proc = start_worker([*args, "--kv-events-replay-endpoint", replay])
            started.append((url, f"{endpoint},{replay}", proc))
        for url, _, proc in started:
            wait_healthy(url, proc, timeout=300)
        yield [(url, endpoint) for url, endpoint, _ in started]
    finally:
        for *_, proc in started:
            stop_group(proc)


def tokenizer_dir() -> str:
    """The tokenizer the workers loaded: the model cache's conversion of the default model."""
    from splitserve.models import gguf_cache
    from splitserve.models.loader import default_model_path

    root = gguf_cache.cache_dir()
    assert root is not None, "the tests run with a model cache"
    entry = gguf_cache.Entry(root, gguf_cache.file_digest(default_model_path()))
    assert entry.has_tokenizer()
    return entry.tokenizer_dir


def warm_up(index: KVIndex, url: str) -> None:
    """Requests to ``url`` until the index has heard from it: past ZMQ's slow-joiner window,
    nothing the worker publishes is lost. Its prompt shares no block with the tests'."""
    deadline = time.monotonic() + 30
    while url not in index.workers:
        assert time.monotonic() < deadline, f"no KV events from {url}"
        body = {"prompt": f"warm up {uuid.uuid4()} " * 8, "max_tokens": 1}
        HTTP.post(url + "/v1/completions", json=body, timeout=60).raise_for_status()
        time.sleep(0.05)


def wait_indexed(index: KVIndex, url: str, stream: list[int]) -> None:
    """Until the index holds every full block of ``stream`` (a finished request's prompt
    and the output tokens it computed) for ``url``: its events have all landed."""
    hashes = hash_blocks(stream, ROOT, BS)
    blocks = index.workers[url]
    wait_until(lambda: blocks.prefix(hashes) == len(hashes), 30, f"{url}'s events")


def test_placement_and_predicted_cache_match_the_workers(workers, make_router):
    urls = [url for url, _ in workers]
    router = make_router(
        workers=urls,
        policy="kv-events",
        kv_events=dict(workers),
        tokenizer=tokenizer_dir(),
    )
    state = router.app.app.state
    index: KVIndex = state.kv_index
    wait_until(lambda: state.kv_events.connected == set(urls), what="the event subscriptions")
    for url in urls:
        warm_up(index, url)
    tokenizer = ChatTokenizer.from_dir(tokenizer_dir())

    conversations = {
        c: [
            {"role": "system", "content": f"Conversation {c}. You are a careful agent. " * 3},
            {"role": "user", "content": f"Task {c}: list three steps to fix test_{c}."},
        ]
        for c in range(3)
    }
    home: dict[int, str] = {}
    for turn in range(3):
        for c, messages in conversations.items():
            body = {
                "messages": messages,
                "max_tokens": 4,
                "temperature": 0,
                "return_token_ids": True,
            }
            ids = tokenizer.request_ids(body)
            predicted = index.matches(urls, ids)
            r = HTTP.post(
                router.url + "/v1/chat/completions",
                json=body,
                headers={"X-Session-Id": str(uuid.uuid4())},
                timeout=120,
            )
            assert r.status_code == 200, r.text
            reply, worker = r.json(), r.headers[DECODE_HEADER]
            assert reply["prompt_token_ids"] == ids
            cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert r.headers[PREDICTED_HEADER] == str(predicted[worker])
            if turn == 0:
                home[c] = worker
                assert cached == 0 and set(predicted.values()) == {0}
            else:
                assert worker == home[c], f"conversation {c}, turn {turn}"
                assert cached == predicted[worker] == max(predicted.values()) > 0
                assert [n for u, n in predicted.items() if u != worker] == [0]
            generated = reply["choices"][0]["token_ids"]
            wait_indexed(index, worker, ids + generated[:-1])
            messages += [
                {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                {"role": "user", "content": f"Step {turn} done; what next?"},
            ]
    assert index.stats.gaps == 0


def test_salted_requests_are_placed_and_predicted_by_their_own_chain(workers, make_router):
    # A cache_salt (or a tenant) hashes the same tokens into other blocks: the index must
    # neither place by another salt's blocks nor predict a hit the worker will not have.
    urls = [url for url, _ in workers]
    router = make_router(
        workers=urls, policy="kv-events", kv_events=dict(workers), tokenizer=tokenizer_dir()
    )
    state = router.app.app.state
    index: KVIndex = state.kv_index
    wait_until(lambda: state.kv_events.connected == set(urls), what="the event subscriptions")
    for url in urls:
        warm_up(index, url)
    messages = [
        {"role": "system", "content": "You review pull requests for a storage team. " * 4},
        {"role": "user", "content": "Review: a retry loop without a bound."},
    ]

    def send(cache_salt: str) -> tuple[int, int, str]:
        body = {"messages": messages, "max_tokens": 2, "temperature": 0, "cache_salt": cache_salt}
        r = HTTP.post(
            router.url + "/v1/chat/completions",
            json=body,
            headers={"X-Session-Id": str(uuid.uuid4())},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        return cached, int(r.headers[PREDICTED_HEADER]), r.headers[DECODE_HEADER]

    cached, predicted, first = send("team-a")
    assert cached == predicted == 0
    ids = ChatTokenizer.from_dir(tokenizer_dir()).request_ids({"messages": messages})
    hashes = hash_blocks(ids[: (len(ids) - 1) // BS * BS], chain_root("|team-a"), BS)
    blocks = index.workers[first]
    wait_until(lambda: blocks.prefix(hashes) == len(hashes), 30, "the salted chain's events")
    cached, predicted, again = send("team-a")
    assert again == first and cached == predicted > 0
    cached, predicted, _ = send("team-b")  # the same tokens, another salt: no hit anywhere
    assert cached == predicted == 0


def test_a_worker_added_at_run_time_is_subscribed_and_a_removed_one_forgotten(workers, make_router):
    (first, first_events), (second, second_events) = workers
    admin = {"Authorization": "Bearer admin"}
    router = make_router(
        workers=[first],
        policy="kv-events",
        kv_events={first: first_events},
        tokenizer=tokenizer_dir(),
        admin_key="admin",
    )
    state = router.app.app.state
    index: KVIndex = state.kv_index
    bad = {"url": second, "role": "decode", "kv_events": "udp://x"}
    r = HTTP.post(router.url + "/workers", json=bad, headers=admin)
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_events"
    joined = {"url": second, "role": "decode", "kv_events": second_events}
    assert HTTP.post(router.url + "/workers", json=joined, headers=admin).status_code == 201
    wait_until(lambda: state.kv_events.connected == {first, second}, what="both subscriptions")
    warm_up(index, second)  # its events reach the index: the new worker is learned
    assert len(index.workers[second]) > 0
    assert HTTP.delete(f"{router.url}/workers/{second}", headers=admin).status_code == 200
    assert second not in state.kv_events.connected and second not in index.workers


def test_kv_events_of_a_joining_worker_need_the_kv_events_policy(workers, make_router):
    (first, _), (second, second_events) = workers
    router = make_router(workers=[first], admin_key="admin")
    joined = {"url": second, "kv_events": second_events}
    r = HTTP.post(router.url + "/workers", json=joined, headers={"Authorization": "Bearer admin"})
    assert r.status_code == 400 and "--policy kv-events" in r.json()["error"]["message"]


def test_a_router_that_starts_late_learns_earlier_blocks_by_replay(workers, make_router):
    # A router replica started (or restarted) after a worker has served: the worker's
    # replay endpoint gives it the blocks stored before it subscribed.
    (url, events), _ = workers
    messages = [
        {"role": "system", "content": "You triage flaky CI jobs for a compiler team. " * 3},
        {"role": "user", "content": f"Job {uuid.uuid4()} timed out twice; why?"},
    ]
    body = {"messages": messages, "max_tokens": 3, "temperature": 0, "return_token_ids": True}
    reply = HTTP.post(url + "/v1/chat/completions", json=body, timeout=120).json()
    stream = reply["prompt_token_ids"] + reply["choices"][0]["token_ids"][:-1]
    router = make_router(
        workers=[url], policy="kv-events", kv_events={url: events}, tokenizer=tokenizer_dir()
    )
    index: KVIndex = router.app.app.state.kv_index
    warm_up(index, url)
    wait_indexed(index, url, stream)
    assert index.stats.replayed > 0 and index.stats.gaps == 0
