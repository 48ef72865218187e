"""The router's worker-facing HTTP pools (``upstream``) and their configuration."""

from __future__ import annotations

import asyncio

import pytest
import uvicorn

from splitserve.router.config import RouterConfig
from splitserve.router.upstream import Upstream


def test_pools_are_split_evenly_and_handed_out_in_turn():
    config = RouterConfig(
        workers=["h:1"], upstream_shards=4, max_connections=64, max_keepalive_connections=32
    )
    upstream = Upstream(config)
    try:
        assert len(upstream.clients) == 4
        picked = [upstream.pick() for _ in range(8)]
        assert picked == upstream.clients * 2
        pool = upstream.clients[0]._transport._pool  # the httpcore pool behind the client
        assert (pool._max_connections, pool._max_keepalive_connections) == (16, 8)
        assert pool._keepalive_expiry == config.keepalive_expiry_s
    finally:
        asyncio.run(upstream.aclose())


def test_idle_connections_retire_before_a_worker_closes_them():
    # Regression: with the router's keep-alive expiry equal to the workers' (uvicorn's 5 s),
    # a request could go out on a connection the worker was closing and fail with a 502
    # (httpx ReadError) although the worker was healthy.
    assert (
        RouterConfig(workers=["h:1"]).keepalive_expiry_s < uvicorn.Config(None).timeout_keep_alive
    )


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("upstream_shards", 0, "upstream_shards must be >= 1"),
        ("keepalive_expiry_s", 0.0, "keepalive_expiry_s must be > 0"),
    ],
)
def test_bad_pool_options_are_rejected(option, value, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig(workers=["h:1"], **{option: value})
