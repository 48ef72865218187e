"""The kv-events policy: the longest prefix the workers report holding, within the session
policy's load bound, else the session ring."""

from __future__ import annotations

import argparse

import pytest

from splitserve.common.kv_events import BlockStored, EventBatch
from splitserve.router.cli import add_router_parser, config_from_args
from splitserve.router.config import RouterConfig
from splitserve.router.kv_index import KVIndex
from splitserve.router.policies import RequestInfo, make_policy
from splitserve.router.policies.session import SessionPolicy
from splitserve.router.worker import LoadReport, Worker

URLS = ["http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"]
PROMPT = list(range(1000, 1041))  # 41 tokens: 2 full blocks of 16 reusable, 8 tokens more


def pool(*loads: int) -> list[Worker]:
    return [
        Worker(u, "decode", report=LoadReport(running=n)) for u, n in zip(URLS, loads, strict=False)
    ]


def holding(**blocks_by_worker: int) -> KVIndex:
    """An index where worker ``wN`` holds the prompt's first ``n`` blocks."""
    index = KVIndex()
    for name, n in blocks_by_worker.items():
        url = URLS[int(name[1:]) - 1]
        event = BlockStored(list(range(n)), None, PROMPT[: 16 * n], 16, None, "GPU", None)
        index.apply(url, 0, EventBatch(0.0, [event], 0))
    return index


def place(index: KVIndex, workers: list[Worker], key: str | None = "s", **options) -> str:
    policy = make_policy("kv-events", index=index, **options)
    return policy.select_worker(workers, RequestInfo(key, prompt_token_ids=PROMPT)).url


def test_the_longest_held_prefix_wins_over_the_session_home():
    workers = pool(0, 0, 0)
    home = SessionPolicy().select_worker(workers, RequestInfo("s")).url
    other = next(u for u in URLS if u != home)
    index = holding(**{f"w{URLS.index(other) + 1}": 2, f"w{URLS.index(home) + 1}": 1})
    assert place(index, workers) == other


def test_a_worker_at_the_load_bound_is_passed_over_for_the_next_longest():
    # Loads 3, 0, 0: the cap is ceil(1.25 * 4 / 3) = 2, so w1 (longest prefix) is full.
    index = holding(w1=2, w2=1)
    assert place(index, pool(3, 0, 0)) == URLS[1]
    assert place(index, pool(1, 1, 0)) == URLS[0]  # cap ceil(1.25 * 3 / 3) = 2: room
    assert place(index, pool(3, 0, 0), load_floor=4) == URLS[0]  # a floor keeps it home


def test_ties_go_to_the_first_on_the_sessions_ring_then_the_least_loaded():
    index = holding(w1=2, w2=2, w3=2)
    for key in ("a", "b", "c", "d"):
        ring_home = SessionPolicy().select_worker(pool(0, 0, 0), RequestInfo(key)).url
        assert place(index, pool(0, 0, 0), key) == ring_home
    assert place(index, pool(1, 0, 1), key=None) == URLS[1]


def test_without_held_blocks_or_tokens_it_places_like_the_session_policy():
    workers = pool(0, 0, 0)
    session = SessionPolicy()
    policy = make_policy("kv-events", index=holding())
    for key in ("a", "b", "c", "d"):
        expected = session.select_worker(workers, RequestInfo(key))
        assert policy.select_worker(workers, RequestInfo(key, prompt_token_ids=PROMPT)) is expected
        assert policy.select_worker(workers, RequestInfo(key)) is expected
    # Held, but only by a worker that is not a candidate (unhealthy, another role).
    index = holding(w3=2)
    assert (
        place(index, workers[:2], "a") == session.select_worker(workers[:2], RequestInfo("a")).url
    )


def test_a_prefix_shorter_than_one_reusable_block_counts_as_nothing():
    index = holding(w2=2)
    policy = make_policy("kv-events", index=index)
    short = RequestInfo("a", prompt_token_ids=PROMPT[:16])  # its only block holds the last token
    expected = SessionPolicy().select_worker(pool(0, 0, 0), RequestInfo("a"))
    assert policy.select_worker(pool(0, 0, 0), short).url == expected.url


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_router_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["router", *argv])


def test_router_flags_configure_the_policy():
    args = parse(
        *("--workers", "h:1", "h:2", "--policy", "kv-events", "--tokenizer", "/models/m"),
        *("--kv-events", "h:1=tcp://h:5557", "--kv-events", "http://h:2/=tcp://h:5558"),
        *("--kv-events-topic", "kv"),
    )
    config = config_from_args(args)
    assert config.kv_events == {"http://h:1": "tcp://h:5557", "http://h:2": "tcp://h:5558"}
    assert (config.tokenizer, config.kv_events_topic, config.policy) == (
        "/models/m",
        "kv",
        "kv-events",
    )


def test_the_policy_without_events_or_a_tokenizer_is_a_config_error():
    with pytest.raises(ValueError, match="kv-events policy needs"):
        RouterConfig(workers=["h:1"], policy="kv-events", tokenizer="/models/m")
    with pytest.raises(ValueError, match="kv-events policy needs"):
        RouterConfig(workers=["h:1"], policy="kv-events", kv_events={"h:1": "tcp://h:1"})
    with pytest.raises(SystemExit, match="WORKER_URL=ENDPOINT"):
        config_from_args(parse("--workers", "h:1", "--kv-events", "tcp://h:5557"))
