"""The router's HTTP client to the workers: one aiohttp session with a keep-alive pool.

Every proxied request and every streamed chunk passes through this client, so its cost is
most of the router's own: aiohttp parses HTTP in C and hands out pooled connections in
constant time, where httpx/httpcore cost about three times the CPU per streamed request
(benchmarks/router_overhead.py, docs/benchmarks.md). The health probes, a few requests a
second, keep their own small httpx client (``probe_client``).
"""

from __future__ import annotations

import asyncio

import aiohttp
import httpx

from splitserve.router.config import RouterConfig

# What a failed exchange with a worker raises: refused or dropped connections, a body cut
# short (``ClientPayloadError``), and timeouts.
UPSTREAM_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, asyncio.TimeoutError)


def dropped(error: BaseException) -> bool:
    """Whether ``error`` is an open connection that the worker closed or reset ("Server
    disconnected", "Connection reset by peer", "Can not write request body"), as opposed to
    one that could not be opened, a timeout or a malformed answer."""
    if isinstance(error, aiohttp.ClientConnectorError):  # refused, unreachable: never opened
        return False
    return isinstance(error, _DROPPED)


_DROPPED = (
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientConnectionResetError,
    aiohttp.ClientOSError,
)


# Headers aiohttp would add to every forwarded request; the workers need none of them.
SKIPPED_HEADERS = ("User-Agent", "Accept", "Accept-Encoding")


def session(config: RouterConfig) -> aiohttp.ClientSession:
    """The pooled session for forwarded requests; create it inside the running loop."""
    connector = aiohttp.TCPConnector(
        limit=config.max_connections,
        limit_per_host=0,
        keepalive_timeout=config.keepalive_expiry_s,
    )
    # No total deadline: a long generation streams for as long as it needs.
    timeout = aiohttp.ClientTimeout(
        total=None, connect=config.connect_timeout_s, sock_read=config.read_timeout_s
    )
    # Bodies pass through as the worker encoded them (``content-encoding`` is forwarded).
    # No cookie jar: the session is shared by every client, so a cookie one worker answer set
    # would go out on other clients' requests (and filtering the jar costs every request).
    # No Accept-Encoding of aiohttp's own either: the client did not ask for compression.
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=SKIPPED_HEADERS,
    )


def probe_client(config: RouterConfig) -> httpx.AsyncClient:
    """The health checker's client: a handful of keep-alive connections."""
    limits = httpx.Limits(max_connections=32, keepalive_expiry=config.keepalive_expiry_s)
    timeout = httpx.Timeout(config.health_timeout_s, connect=config.connect_timeout_s)
    return httpx.AsyncClient(timeout=timeout, limits=limits)
