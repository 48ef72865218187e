"""The router's HTTP clients to the workers: keep-alive pools, split into shards.

httpcore 1.0's pool walks every connection it holds on each request and on each response
close (and polls every idle socket for a server-side close), so one pool serving 64+
concurrent streams spends milliseconds per request on its own bookkeeping. ``Upstream``
holds several small pools and hands them out in turn: each walks only its share of the
connections, and the per-request cost stays flat as concurrency grows.
"""

from __future__ import annotations

import itertools

import httpx

from splitserve.router.config import RouterConfig


class Upstream:
    """``shards`` httpx clients with one configuration; ``pick()`` returns the next."""

    def __init__(self, config: RouterConfig) -> None:
        shards = config.upstream_shards
        # No total deadline: a long generation streams for as long as it needs.
        timeout = httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s)
        limits = httpx.Limits(
            max_connections=max(1, config.max_connections // shards),
            max_keepalive_connections=max(1, config.max_keepalive_connections // shards),
            keepalive_expiry=config.keepalive_expiry_s,
        )
        tls = httpx.create_ssl_context()  # built once: loading the CA store takes ~50 ms
        self.clients = [
            httpx.AsyncClient(timeout=timeout, limits=limits, verify=tls) for _ in range(shards)
        ]
        self._turn = itertools.cycle(self.clients)

    def pick(self) -> httpx.AsyncClient:
        return next(self._turn)

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()
