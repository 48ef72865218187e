"""The router's worker-facing HTTP client (``upstream``) and its configuration."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import uvicorn

from splitserve.router import upstream
from splitserve.router.config import RouterConfig


def test_session_pools_connections_with_the_configured_limits():
    config = RouterConfig(workers=["h:1"], max_connections=64, keepalive_expiry_s=1.5)

    async def build() -> tuple[int, int, float, bool]:
        session = upstream.session(config)
        try:
            c = session.connector
            return c.limit, c.limit_per_host, c._keepalive_timeout, session.auto_decompress
        finally:
            await session.close()

    assert asyncio.run(build()) == (64, 0, 1.5, False)


def test_idle_connections_retire_before_a_worker_closes_them():
    # Regression: with the router's keep-alive expiry equal to the workers' (uvicorn's 5 s),
    # a request could go out on a connection the worker was closing and fail with a 502
    # (a read error before the first byte) although the worker was healthy.
    default = RouterConfig(workers=["h:1"]).keepalive_expiry_s
    assert default < uvicorn.Config(None).timeout_keep_alive


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("max_connections", 0, "max_connections must be >= 1"),
        ("keepalive_expiry_s", 0.0, "keepalive_expiry_s must be > 0"),
    ],
)
def test_bad_pool_options_are_rejected(option, value, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig(workers=["h:1"], **{option: value})


def test_only_connections_closed_under_a_request_count_as_dropped():
    refused = aiohttp.ClientConnectorError.__new__(aiohttp.ClientConnectorError)
    assert upstream.dropped(aiohttp.ServerDisconnectedError())
    assert upstream.dropped(aiohttp.ClientOSError(32, "Can not write request body"))
    assert upstream.dropped(aiohttp.ClientConnectionResetError("Cannot write to closing transport"))
    assert not upstream.dropped(refused)  # never opened: nothing to redial
    assert not upstream.dropped(TimeoutError())
    assert not upstream.dropped(aiohttp.ClientPayloadError("body cut short"))
