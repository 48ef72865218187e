"""``/v1/responses`` through the router over two real workers: every turn of a chain lands
on the worker holding its conversation and KV, through a second router replica too (which
is what a restarted router is), streamed and not; stored responses are fetched and deleted
through the router; another tenant sees none of them."""

from __future__ import annotations

import json
import secrets

import openai
import pytest
from procs import start_worker, stop_group, wait_healthy_or_restart

from splitserve.router.config import RouterConfig
from splitserve.router.proxy import DECODE_HEADER

from .conftest import RouterServer

pytestmark = pytest.mark.timeout(900)

SECRET = secrets.token_hex(16)
KEYS = {"alice": "sk-alice", "bob": "sk-bob"}
INSTRUCTIONS = "You are a terse assistant. Answer in a few words."


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("responses-routing") / "keys.json"
    path.write_text(json.dumps([{"key": k, "tenant": t} for t, k in KEYS.items()]))
    return path


@pytest.fixture(scope="module")
def workers(keys_file):
    def start():
        args = ["--max-model-len", "1024", "--api-keys", str(keys_file)]
        return start_worker(args, secret=SECRET)

    started = [start() for _ in range(2)]
    try:
        for i, (url, proc) in enumerate(started):
            started[i] = wait_healthy_or_restart(url, proc, start)  # its port may be taken
        yield [url for url, _ in started]
    finally:
        for _, proc in started:
            stop_group(proc)


def router_over(workers: list[str], keys_file) -> RouterServer:
    config = RouterConfig.from_kwargs(
        workers=workers,
        api_keys_file=str(keys_file),
        cluster_secret=SECRET.encode(),
        health_interval_s=0.2,
    )
    return RouterServer(config)


@pytest.fixture(scope="module")
def routers(workers, keys_file):
    first, second = router_over(workers, keys_file), router_over(workers, keys_file)
    yield first, second
    first.stop()
    second.stop()


def client(router: RouterServer, who: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key=KEYS[who], max_retries=0, timeout=120)


def create(router: RouterServer, **kw):
    """A response and the worker that served it."""
    raw = client(router).responses.with_raw_response.create(
        instructions=INSTRUCTIONS, temperature=0, max_output_tokens=6, **kw
    )
    return raw.parse(), raw.headers[DECODE_HEADER]


def test_every_turn_of_a_chain_lands_on_its_worker(routers, workers):
    homes = set()
    for c in range(4):  # new chains spread over both workers; each stays home
        r, home = create(routers[0], input=f"Chain {c}: name a fruit.")
        homes.add(home)
        for t in range(3):
            router = routers[t % 2]  # alternate replicas: neither keeps a table
            previous = r
            r, worker = create(router, input=f"Turn {t}: another?", previous_response_id=r.id)
            assert worker == home
            context = previous.usage.input_tokens + previous.usage.output_tokens
            assert r.usage.input_tokens_details.cached_tokens >= context - 16
    assert homes <= set(workers)


def test_a_restarted_router_streams_the_next_turn_to_the_chains_worker(routers, workers, keys_file):
    first, home = create(routers[0], input="Name a city.")
    restarted = router_over(workers, keys_file)  # a router that never saw the chain
    try:
        stream = client(restarted).responses.with_raw_response.create(
            input="Another one?",
            previous_response_id=first.id,
            instructions=INSTRUCTIONS,
            temperature=0,
            max_output_tokens=6,
            stream=True,
        )
        assert stream.headers[DECODE_HEADER] == home
        events = list(stream.parse())
    finally:
        restarted.stop()
    assert events[0].type == "response.created" and events[-1].type in (
        "response.completed",
        "response.incomplete",
    )
    assert events[-1].response.previous_response_id == first.id
    assert events[-1].response.usage.input_tokens_details.cached_tokens > 0


def test_get_and_delete_through_the_router(routers):
    r, _ = create(routers[0], input="Say yes.")
    alice = client(routers[1])
    assert alice.responses.retrieve(r.id).output_text == r.output_text
    bob = client(routers[1], "bob")
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(r.id)
    alice.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        create(routers[0], input="Again?", previous_response_id=r.id)
    assert e.value.body["code"] == "previous_response_not_found"
