"""Resuming a stream that broke after its first byte on the session's next decode workers.

The client already holds part of the answer, so the request is not retried: the router asks
the next worker to continue from the tokens already delivered (``migration``: the request
itself with a ``resume`` field on builtin workers; on vLLM ones a text completion, or the
request again whose part the client has is skipped), one leg per worker, and relays the rest
into the same client stream.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from splitserve.router.forwarding import Forwarding, WorkerFailed
from splitserve.router.membership import Membership
from splitserve.router.metrics import RouterMetrics
from splitserve.router.migration import IncompleteStream, error_event
from splitserve.router.policies import RequestInfo, RoutingPolicy
from splitserve.router.replay import ReplayDiverged
from splitserve.router.response import Response, UpstreamError
from splitserve.router.stream_log import StreamLog
from splitserve.router.upstream import Pool
from splitserve.router.vouch import Vouch
from splitserve.router.worker import Worker

log = logging.getLogger(__name__)


class Resumer:
    """``pick(role, info, excluded)`` chooses the next worker (and adds it to ``excluded``);
    ``failed(worker, role, error)`` reports a worker's failure."""

    def __init__(
        self,
        max_retries: int,
        membership: Membership,
        policy: RoutingPolicy,
        client: Pool,
        metrics: RouterMetrics,
        vouch: Vouch,
        pick: Callable[[str, RequestInfo, list[str]], Worker | None],
        failed: Callable[[Worker, str, Exception], None],
    ) -> None:
        self.max_retries = max_retries
        self.membership = membership
        self.policy = policy
        self.client = client
        self.metrics = metrics
        self.vouch = vouch
        self.pick = pick
        self.failed = failed

    async def after(
        self, failure: Exception, worker: Worker, forwarding: Forwarding
    ) -> AsyncIterator[bytes]:
        """What the client gets when the first leg broke after its first byte: the client
        already has part of the answer, so it is resumed elsewhere, not retried."""
        self.failed(worker, "decode", failure)
        self.metrics.midstream_failures.inc()
        if forwarding.relay is None:  # relayed as it was: nothing to resume from
            yield error_event("the decode worker failed mid-stream")
            return
        async for out in self._migrate(forwarding):
            yield out

    async def _migrate(self, forwarding: Forwarding) -> AsyncIterator[bytes]:
        """Continue a broken stream on the session's next decode workers, one leg each."""
        relay, excluded = forwarding.relay, forwarding.excluded
        assert relay is not None and excluded is not None
        # Only the ending was lost: the usage and [DONE], or the finish after the tool calls.
        if relay.log.ended:
            for out in relay.finish_locally():
                yield out
            return
        for _ in range(self.max_retries + 1):
            worker = self.pick("decode", forwarding.info, excluded) if relay.log.resumable else None
            if worker is None:
                break
            self.metrics.migrations.inc()
            log.warning("resuming a stream on %s (%s)", worker.url, relay.mode)
            try:
                max_model_len = await self._max_model_len(worker, relay.log, forwarding)
                for out in relay.end_spent(max_model_len):
                    yield out
                remaining = relay.remaining(max_model_len)
                if remaining <= 0:
                    for out in relay.finish_locally():
                        yield out
                    return
                try:
                    payload = json.dumps(relay.resume_body(remaining)).encode()
                except RecursionError:  # the client's fields nest too deep to send again
                    break
                async with self._leg(worker, relay.resume_path, payload, forwarding) as upstream:
                    # SSE comments are ignored by clients; this one helps debugging and tests.
                    yield f": splitserve migrated to {worker.url} ({relay.mode})\n\n".encode()
                    async for out in relay.relay(pieces(upstream)):
                        yield out
                relay.resumed_on(worker.url)
                return
            except ReplayDiverged as e:  # the worker is fine; what it replays is not the same
                log.warning("a replayed stream on %s diverged: %s", worker.url, e)
                self.metrics.replay_divergences.inc()
                break
            except (UpstreamError, IncompleteStream, ValueError, WorkerFailed) as e:
                self.failed(worker, "decode", e)
        yield relay.error_event(relay.failure())

    @asynccontextmanager
    async def _leg(
        self, worker: Worker, path: str, payload: bytes, forwarding: Forwarding
    ) -> AsyncIterator[Response]:
        """One resumed leg's upstream stream, counted in the worker's load while it runs."""
        self.metrics.sent(worker.url, "decode")
        worker.in_flight += 1
        try:
            assert forwarding.headers is not None
            headers = self.vouch.headers(
                forwarding.headers, forwarding.tenant, "POST", path, payload
            )
            upstream = await self.client.request("POST", worker.url, path, headers, payload)
            try:
                if upstream.status != 200:
                    raise WorkerFailed(f"HTTP {upstream.status} on resume")
                self.membership.report(worker.url, ok=True)
                yield upstream
            finally:
                upstream.release()
        finally:
            worker.in_flight -= 1
            self.policy.on_request_complete(worker, forwarding.info)

    async def _max_model_len(
        self, worker: Worker, stream: StreamLog, forwarding: Forwarding
    ) -> int | None:
        """The worker's context length, needed only when the client set no ``max_tokens``."""
        if stream.max_tokens is not None:
            return None
        assert forwarding.headers is not None
        path = "/v1/models"
        headers = self.vouch.headers(forwarding.headers, forwarding.tenant, "GET", path, None)
        r = await self.client.request("GET", worker.url, path, headers)
        try:
            body = await r.read()
        finally:
            r.release()
        if r.status != 200:
            raise WorkerFailed(f"HTTP {r.status} from /v1/models")
        return int(json.loads(body)["data"][0]["max_model_len"])


async def pieces(response: Response) -> AsyncIterator[bytes]:
    while piece := await response.piece():
        yield piece
