"""Forwarding one request: placement, the optional prefill leg, retries, streaming relay.

A request may be retried on another worker until its first byte reaches the client: a
connection error, a 5xx, or a stream that dies before its first chunk all count as the
worker's failure (its circuit breaker hears of it) and the next candidate is tried. After
the first byte the client owns a partial answer, so a failure ends the stream with an SSE
error event (migration of a live stream is not implemented yet: it needs the workers
to stream token ids, see the router's report).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from splitserve.router import disagg
from splitserve.router.config import RouterConfig
from splitserve.router.errors import RouterError, no_worker
from splitserve.router.membership import Membership
from splitserve.router.metrics import RouterMetrics
from splitserve.router.policies import RequestInfo, RoutingPolicy
from splitserve.router.policies.session import SyncedRing
from splitserve.router.session import prefix_key, session_key
from splitserve.router.worker import Worker

log = logging.getLogger(__name__)

DECODE_HEADER = "X-Splitserve-Decode-Worker"
PREFILL_HEADER = "X-Splitserve-Prefill-Worker"
_PASSED_RESPONSE_HEADERS = ("content-type", "content-encoding", "cache-control")


class WorkerFailed(Exception):
    """The worker failed before sending its first byte: the request may go elsewhere."""


class RelayResponse(StreamingResponse):
    """A streaming response that always runs ``on_close``, even when the client leaves
    before the first chunk (Starlette skips ``background`` tasks when it cancels)."""

    def __init__(
        self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]], **kwargs: Any
    ) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()


@dataclass(slots=True)
class Placement:
    """Where one request runs, decided before any byte is sent."""

    info: RequestInfo
    home: str | None  # the session's home worker (metrics only)
    prefill: Worker | None = None
    kv_params: dict[str, Any] | None = None


class Proxy:
    """Routes and forwards OpenAI requests to the workers in ``membership``."""

    def __init__(
        self,
        config: RouterConfig,
        membership: Membership,
        decode: RoutingPolicy,
        prefill: RoutingPolicy,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
    ) -> None:
        self.config = config
        self.membership = membership
        self.policies = {"decode": decode, "prefill": prefill}
        self.client = client
        self.metrics = metrics
        self._home_ring = SyncedRing(config.vnodes)  # over all decode members, healthy or not

    async def completion(self, request: Request, path: str) -> Response:
        """``POST /v1/chat/completions`` or ``/v1/completions``."""
        body = await _json_object(request)
        headers = self._forward_headers(request)
        placement = self._place(request, body)
        excluded: list[str] = []
        decode = self._pick("decode", placement.info, excluded)
        if decode is None:
            raise no_worker("decode")
        if self.config.disaggregate:
            await self._remote_prefill(path, body, headers, placement, decode)
        if placement.kv_params is not None:
            body = disagg.decode_body(body, placement.kv_params)
        payload = json.dumps(body).encode()
        stream = body.get("stream") is True
        return await self._with_retries(
            "decode",
            placement,
            excluded,
            decode,
            lambda w: self._send(w, "POST", path, payload, headers, stream, placement),
        )

    async def models(self, request: Request) -> Response:
        """``GET /v1/models`` from any healthy worker."""
        info = RequestInfo()
        headers = self._forward_headers(request)
        placement = Placement(info, None)
        excluded: list[str] = []
        first = self._pick("decode", info, excluded)
        if first is None:
            raise no_worker("decode")
        return await self._with_retries(
            "decode",
            placement,
            excluded,
            first,
            lambda w: self._send(w, "GET", "/v1/models", None, headers, False, placement),
        )

    def _place(self, request: Request, body: dict[str, Any]) -> Placement:
        key = session_key(request.headers, body, self.config.prefix_chars)
        info = RequestInfo(
            session_key=None if key is None else key.key,
            prefix_key=prefix_key(body, self.config.prefix_chars),
            prompt_tokens=int(disagg.uncached_chars(body, False) / self.config.chars_per_token),
        )
        home = None
        if info.session_key is not None:
            ring = self._home_ring.sync([w for w in self.membership.all() if w.serves("decode")])
            home = ring.owner(info.session_key)
        return Placement(info, home)

    def _pick(self, role: str, info: RequestInfo, excluded: list[str]) -> Worker | None:
        worker = self.policies[role].select_worker(self.membership.candidates(role, excluded), info)
        if worker is not None:
            excluded.append(worker.url)
        return worker

    async def _with_retries(
        self,
        role: str,
        placement: Placement,
        excluded: list[str],
        first: Worker,
        send: Callable[[Worker], Awaitable[Response]],
    ) -> Response:
        worker: Worker | None = first
        errors: list[str] = []
        for attempt in range(self.config.max_retries + 1):
            if worker is None:
                break
            if attempt:
                self.metrics.retries.labels(role).inc()
            try:
                return await send(worker)
            except WorkerFailed as e:
                errors.append(f"{worker.url}: {e}")
                worker = self._pick(role, placement.info, excluded)
        if not errors:
            raise no_worker(role)
        raise RouterError(
            502, f"every {role} worker tried failed ({'; '.join(errors)})", code="worker_failed"
        )

    async def _send(
        self,
        worker: Worker,
        method: str,
        path: str,
        payload: bytes | None,
        headers: dict[str, str],
        stream: bool,
        placement: Placement,
    ) -> Response:
        role = "decode"
        self.metrics.requests.labels(worker.url, role).inc()
        request = self.client.build_request(
            method, worker.url + path, content=payload, headers=headers
        )
        worker.in_flight += 1
        started = time.perf_counter()
        upstream: httpx.Response | None = None

        closed = False

        async def close_once() -> None:
            # Called from the error path, after a full read, or when the relay ends.
            nonlocal closed
            if closed:
                return
            closed = True
            if upstream is not None:
                await upstream.aclose()
            worker.in_flight -= 1
            self.policies[role].on_request_complete(worker, placement.info)

        try:
            upstream = await self.client.send(request, stream=True)
            self.metrics.latency.observe(time.perf_counter() - started)
            if upstream.status_code >= 500:
                raise WorkerFailed(f"HTTP {upstream.status_code}")
            if not stream or upstream.status_code >= 400:
                content = await upstream.aread()
                self._succeeded(worker, role, placement)
                await close_once()
                return Response(
                    content, upstream.status_code, self._headers(upstream, worker, placement)
                )
            chunks = upstream.aiter_raw()
            first = await anext(chunks, b"")
            if not first:
                raise WorkerFailed("the stream ended before its first byte")
        except (httpx.HTTPError, WorkerFailed) as e:
            await close_once()
            self._failed(worker, role, e)
            raise e if isinstance(e, WorkerFailed) else WorkerFailed(repr(e)) from e
        self._succeeded(worker, role, placement)
        return RelayResponse(
            self._relay(first, chunks, worker),
            close_once,
            status_code=upstream.status_code,
            headers=self._headers(upstream, worker, placement),
        )

    async def _relay(
        self, first: bytes, chunks: AsyncIterator[bytes], worker: Worker
    ) -> AsyncIterator[bytes]:
        yield first
        try:
            async for chunk in chunks:
                yield chunk
        except httpx.HTTPError as e:
            # The client already has part of the answer: it cannot be retried elsewhere.
            self._failed(worker, "decode", e)
            self.metrics.midstream_failures.inc()
            error = {
                "message": f"the decode worker failed mid-stream: {e!r}",
                "type": "server_error",
                "param": None,
                "code": "worker_failed",
            }
            yield f"data: {json.dumps({'error': error})}\n\n".encode()

    async def _remote_prefill(
        self,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        placement: Placement,
        decode: Worker,
    ) -> None:
        on_home = decode.url == placement.home
        tokens = disagg.uncached_chars(body, on_home) / self.config.chars_per_token
        if tokens < self.config.remote_prefill_threshold:
            self.metrics.remote_prefills.labels("skipped").inc()
            return
        excluded = [decode.url]
        worker = self._pick("prefill", placement.info, excluded)
        if worker is None:
            self.metrics.remote_prefills.labels("fallback").inc()
            return
        payload = json.dumps(disagg.prefill_body(body)).encode()
        self.metrics.requests.labels(worker.url, "prefill").inc()
        params = None
        try:
            r = await self.client.post(worker.url + path, content=payload, headers=headers)
            if r.status_code >= 500:
                raise WorkerFailed(f"HTTP {r.status_code}")
            params = disagg.accepted_params(r.json()) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, WorkerFailed) as e:
            self._failed(worker, "prefill", e)
        # Without params the decode worker simply prefills locally: slower, never wrong.
        self.metrics.remote_prefills.labels("ok" if params else "fallback").inc()
        if params is not None:
            placement.prefill, placement.kv_params = worker, params

    def _succeeded(self, worker: Worker, role: str, placement: Placement) -> None:
        self.membership.report(worker.url, ok=True)
        if role == "decode" and placement.info.session_key is not None:
            self.metrics.turn(placement.info.session_key, worker.url, placement.home)

    def _failed(self, worker: Worker, role: str, error: Exception) -> None:
        log.warning("%s worker %s failed: %r", role, worker.url, error)
        self.metrics.failures.labels(worker.url, role).inc()
        self.membership.report(worker.url, ok=False)

    def _forward_headers(self, request: Request) -> dict[str, str]:
        headers = {
            "content-type": "application/json",
            "x-request-id": request.headers.get("x-request-id") or uuid.uuid4().hex,
        }
        auth = (
            f"Bearer {self.config.worker_api_key}"
            if self.config.worker_api_key
            else request.headers.get("authorization")
        )
        if auth:
            headers["authorization"] = auth
        return headers

    def _headers(
        self, upstream: httpx.Response, worker: Worker, placement: Placement
    ) -> dict[str, str]:
        out = {k: upstream.headers[k] for k in _PASSED_RESPONSE_HEADERS if k in upstream.headers}
        out["x-request-id"] = upstream.request.headers.get("x-request-id", "")
        out[DECODE_HEADER] = worker.url
        if placement.prefill is not None:
            out[PREFILL_HEADER] = placement.prefill.url
        return out


async def _json_object(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (ValueError, RecursionError) as e:
        raise RouterError(400, f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise RouterError(400, "the request body must be a JSON object")
    return body
