"""Sending one request to a worker, and to the next candidates until its first byte.

A connection error, a 5xx, or a stream that dies before its first chunk counts as the worker's
failure (its circuit breaker hears of it) and the next candidate is tried. A connection the
worker closed or reset before answering (most often a kept-alive one it was closing as the
request went out) is tried once more on the same worker first, over another connection, so a
lone worker's keep-alive race is not a 502. What happens after the first byte is the
``resume`` callback's (``Resumer.after``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from splitserve.router.errors import RouterError, no_worker
from splitserve.router.forwarding import Forwarding, WorkerFailed
from splitserve.router.headers import reply_headers
from splitserve.router.leg import Leg
from splitserve.router.membership import Membership
from splitserve.router.metrics import RouterMetrics
from splitserve.router.policies import RequestInfo, RoutingPolicy
from splitserve.router.replies import Buffered, Reply, Streamed
from splitserve.router.response import Response, UpstreamError, dropped
from splitserve.router.timing import now
from splitserve.router.upstream import Pool
from splitserve.router.vouch import Vouch
from splitserve.router.worker import Worker

log = logging.getLogger(__name__)

# What a streamed reply does when its worker fails after the first byte (Resumer.after).
ResumeFn = Callable[[Exception, Worker, Forwarding], AsyncIterator[bytes]]


class Sender:
    """Picks workers through the policies, sends, retries, and reports each outcome to the
    membership, the policies and the metrics."""

    def __init__(
        self,
        max_retries: int,
        membership: Membership,
        policies: dict[str, RoutingPolicy],
        client: Pool,
        metrics: RouterMetrics,
        vouch: Vouch,
    ) -> None:
        self.max_retries = max_retries
        self.membership = membership
        self.policies = policies
        self.client = client
        self.metrics = metrics
        self.vouch = vouch
        # Set by the owner once its Resumer, which picks through this sender, exists.
        self.resume: ResumeFn | None = None

    def pick(self, role: str, info: RequestInfo, excluded: list[str]) -> Worker | None:
        worker = self.policies[role].select_worker(self.membership.candidates(role, excluded), info)
        if worker is not None:
            excluded.append(worker.url)
        return worker

    async def with_retries(
        self,
        role: str,
        forwarding: Forwarding,
        excluded: list[str],
        first: Worker,
        send: Callable[[Worker], Awaitable[Reply]],
    ) -> Reply:
        worker: Worker | None = first
        errors: list[str] = []
        redialled = False
        for attempt in range(self.max_retries + 1):
            if worker is None:
                break
            if attempt:
                self.metrics.retries.labels(role).inc()
            try:
                return await send(worker)
            except WorkerFailed as e:
                errors.append(f"{worker.url}: {e}")
                if e.dropped and worker.healthy and not redialled:
                    redialled = True  # the same worker once more, over another connection
                    continue
                worker = self.pick(role, forwarding.info, excluded)
        if not errors:
            raise no_worker(role)
        raise RouterError(
            502, f"every {role} worker tried failed ({'; '.join(errors)})", code="worker_failed"
        )

    async def send(
        self,
        worker: Worker,
        method: str,
        path: str,
        payload: bytes | None,
        headers: dict[str, str],
        stream: bool,
        forwarding: Forwarding,
    ) -> Reply:
        role = "decode"
        self.metrics.sent(worker.url, role)
        worker.in_flight += 1
        started = now()
        upstream: Response | None = None

        closed = False

        async def close_once() -> None:
            # Called from the error path, after a full read, or when the relay ends.
            nonlocal closed
            if closed:
                return
            closed = True
            if upstream is not None:
                upstream.release()  # back to the pool when fully read, else closed
            worker.in_flight -= 1
            self.policies[role].on_request_complete(worker, forwarding.info)

        try:
            signed = self.vouch.headers(headers, forwarding.tenant, method, path, payload)
            upstream = await self.client.request(method, worker.url, path, signed, payload)
            timeline = forwarding.timeline
            headers_at = now()
            self.metrics.latency.observe(headers_at - started)
            if upstream.status >= 500:
                raise WorkerFailed(f"HTTP {upstream.status}")
            if not stream or upstream.status >= 400:
                content = await upstream.read()
                self.succeeded(worker, role, forwarding)
                await close_once()
                if timeline is not None:
                    timeline.headers, timeline.upstream_first = headers_at, now()
                return Buffered(
                    upstream.status,
                    reply_headers(upstream, worker, forwarding, headers),
                    content,
                    forwarding.info.session_key,
                )
            first = await upstream.piece()
            if not first:
                raise WorkerFailed("the stream ended before its first byte")
            if timeline is not None:
                timeline.headers, timeline.upstream_first = headers_at, now()
        except (UpstreamError, WorkerFailed) as e:
            await close_once()
            self.failed(worker, role, e)
            if isinstance(e, WorkerFailed):
                raise
            raise WorkerFailed(str(e), dropped=upstream is None and dropped(e)) from e
        self.succeeded(worker, role, forwarding)
        return Streamed(
            upstream.status,
            reply_headers(upstream, worker, forwarding, headers),
            Leg(first, upstream, forwarding.relay),
            lambda failure: self.resume(failure, worker, forwarding),
            close_once,
            forwarding.info.session_key,
        )

    def succeeded(self, worker: Worker, role: str, forwarding: Forwarding) -> None:
        self.membership.report(worker.url, ok=True)
        if role == "decode" and forwarding.info.session_key is not None:
            self.metrics.turn(forwarding.info.session_key, worker.url, forwarding.home)

    def failed(self, worker: Worker, role: str, error: Exception) -> None:
        log.warning("%s worker %s failed: %r", role, worker.url, error)
        self.metrics.failed(worker.url, role)
        self.membership.report(worker.url, ok=False)
