"""Prefetch hints: tell a session's decode worker its next turn is coming (``POST
/v1/kv/prefetch``), so it promotes the session's KV from host RAM or disk while the request
is still routed."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from splitserve.router.response import UpstreamError
from splitserve.router.upstream import Pool
from splitserve.router.vouch import Vouch
from splitserve.router.worker import Worker

log = logging.getLogger(__name__)

_HINT_TIMEOUT_S = 5.0


class PrefetchHints:
    def __init__(self, client: Pool, vouch: Vouch) -> None:
        self.client, self.vouch = client, vouch
        self._pending: set[asyncio.Future] = set()

    def send(
        self, worker: Worker, body: dict[str, Any], headers: dict[str, str], tenant: str
    ) -> None:
        """Fire and forget: the worker promotes the prompt's tiered KV while this request
        goes through its prefill leg and queue. The hint is the request body itself, which
        the worker tokenizes as it will the request. A lost hint costs only itself."""

        async def send() -> None:
            try:
                hint = json.dumps(body).encode()
                path = "/v1/kv/prefetch"
                signed = self.vouch.headers(headers, tenant, "POST", path, hint)
                r = await self.client.request(
                    "POST", worker.url, path, signed, hint, _HINT_TIMEOUT_S
                )
                try:
                    await r.read()
                finally:
                    r.release()
            except UpstreamError as e:
                log.debug("prefetch hint to %s failed: %r", worker.url, e)

        task = asyncio.ensure_future(send())
        self._pending.add(task)  # keep a reference until it is done
        task.add_done_callback(self._pending.discard)
