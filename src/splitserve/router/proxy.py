"""Forwarding one request: placement, the optional prefill leg, retries, streaming relay.

A request may be retried on another worker until its first byte reaches the client: a
connection error, a 5xx, or a stream that dies before its first chunk all count as the
worker's failure (its circuit breaker hears of it) and the next candidate is tried. A
connection the worker closed or reset before answering (most often a kept-alive one it was
closing as the request went out) is tried once more on the same worker first, over another
connection, so a lone worker's keep-alive race is not a 502. After
the first byte the client owns a partial answer, so a streamed request migrates instead: the
router resumes it on the session's next worker from the tokens already delivered (see
``migration``) and the client's stream continues. Only when no worker can take it over does
the stream end with an SSE error event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from splitserve.common.tenants import DEFAULT_TENANT, kv_salt
from splitserve.router import disagg
from splitserve.router.body import forwarded
from splitserve.router.body import parse as parse_body
from splitserve.router.config import RouterConfig
from splitserve.router.errors import RouterError, no_worker
from splitserve.router.leg import Leg
from splitserve.router.membership import Membership
from splitserve.router.metrics import RouterMetrics
from splitserve.router.migration import (
    TOKEN_IDS_FIELD,
    IncompleteStream,
    StreamLog,
    StreamRelay,
    resumable_request,
)
from splitserve.router.policies import RequestInfo, RoutingPolicy
from splitserve.router.policies.session import SyncedRing
from splitserve.router.replies import Buffered, Reply, Streamed
from splitserve.router.session import (
    SESSION_HEADER,
    chain_key,
    keyed_by_chain,
    prefix_key,
    session_key,
)
from splitserve.router.timing import Timeline, now
from splitserve.router.upstream import Pool, Response, UpstreamError, dropped
from splitserve.router.vouch import Vouch
from splitserve.router.worker import Worker

if TYPE_CHECKING:
    from splitserve.router.front import Admission
    from splitserve.router.prompt_tokens import ChatTokenizer

log = logging.getLogger(__name__)

DECODE_HEADER = "X-Splitserve-Decode-Worker"
# With the kv-events policy: the prompt tokens the router's index expected the decode worker
# to hold when it placed the request (compare ``usage.prompt_tokens_details.cached_tokens``).
PREDICTED_HEADER = "X-Splitserve-Predicted-Cached-Tokens"
PREFILL_HEADER = "X-Splitserve-Prefill-Worker"
_PASSED_RESPONSE_HEADERS = ("content-type", "content-encoding", "cache-control")
_HINT_TIMEOUT_S = 5.0
PEER_FIELD = "kv_peer"  # the worker to pull a moved turn's KV from (worker.peer)
# What only the router writes: these make a worker contact other hosts.
ROUTER_FIELDS = (PEER_FIELD, "kv_transfer_params")


class WorkerFailed(Exception):
    """The worker failed before sending its first byte: the request may go elsewhere.
    ``dropped``: an open connection was closed or reset before any answer (``upstream``)."""

    def __init__(self, message: str, dropped: bool = False) -> None:
        super().__init__(message)
        self.dropped = dropped


@dataclass(slots=True)
class Placement:
    """Where one request runs, decided before any byte is sent."""

    info: RequestInfo
    home: str | None  # the session's home worker (metrics only)
    prefill: Worker | None = None
    kv_params: dict[str, Any] | None = None
    # Streamed requests: what was delivered, so the stream can move to another worker.
    relay: StreamRelay | None = None
    headers: dict[str, str] | None = None
    excluded: list[str] | None = None  # decode workers tried so far
    timeline: Timeline | None = None
    predicted: tuple[str, int] | None = None  # (decode worker, tokens its KV events showed)
    tenant: str = DEFAULT_TENANT


class Proxy:
    """Routes and forwards OpenAI requests to the workers in ``membership``."""

    def __init__(
        self,
        config: RouterConfig,
        membership: Membership,
        decode: RoutingPolicy,
        prefill: RoutingPolicy,
        client: Pool,
        metrics: RouterMetrics,
        tokenizer: ChatTokenizer | None = None,
        vouch: Vouch | None = None,
    ) -> None:
        self.config = config
        self.vouch = vouch or Vouch()
        self.tokenizer = tokenizer  # prompt ids for the policies (the kv-events policy)
        self.membership = membership
        self.policies = {"decode": decode, "prefill": prefill}
        self.client = client
        self.metrics = metrics
        self._home_ring = SyncedRing(config.vnodes)  # over all decode members, healthy or not
        self._hints: set[asyncio.Future] = set()

    async def completion(
        self,
        client_headers: Mapping[str, str],
        raw: bytes,
        path: str,
        tenant: str,
        timeline: Timeline,
        admission: Admission | None = None,
    ) -> Reply:
        """``POST /v1/chat/completions`` or ``/v1/completions`` for ``tenant``;
        ``client_headers`` by lower-case name, ``raw`` the request body; ``admission``
        counts it in its tenant's in-flight limits once its session is known."""
        body = parse_body(raw)
        # Only the router names peers and transfer sources (workers will call them): a
        # client's are dropped, never signed.
        client_written = [name for name in ROUTER_FIELDS if name in body]
        for name in client_written:
            del body[name]
        rewrite = self._salt_for_vllm(body, tenant) or bool(client_written)
        timeline.parsed = now()
        headers = self._forward_headers(client_headers)
        placement = self._place(client_headers, body, timeline, self._kv_salt(body, tenant))
        placement.tenant = tenant
        responses = keyed_by_chain(path)
        if responses:  # keyed by its response chain instead (``session.chain_key``)
            self._place_chain(placement, body, headers)
        if admission is not None:
            admission.admit(placement.info.session_key)
        excluded: list[str] = []
        decode = self._pick("decode", placement.info, excluded)
        if decode is None:
            raise no_worker("decode")
        placement.predicted = self._predicted(decode, placement.info)
        timeline.routed = now()
        # The prefill leg, prefetch and peer hints and resumed streams speak chat and
        # completions only.
        if self.config.prefetch_hints and placement.info.session_key is not None and not responses:
            self._prefetch_hint(decode, body, headers, tenant)
        if self.config.disaggregate and not responses:
            await self._remote_prefill(path, body, headers, placement, decode)
        added: dict[str, Any] = {}  # the router's fields in the forwarded body
        if placement.kv_params is not None:
            added.update(disagg.decode_fields(placement.kv_params))
        elif self.config.kv_peer_fetch and not responses:
            added.update(self._peer_hint(decode, placement))
        stream = body.get("stream") is True
        if stream and not responses and resumable_request(body):
            log = StreamLog.of(body, chat=path.endswith("/chat/completions"))
            placement.relay = StreamRelay(log, body)
            placement.headers, placement.excluded = headers, excluded
            added.update(TOKEN_IDS_FIELD)
        payload = forwarded(raw, body, added, rewrite)
        return await self._with_retries(
            "decode",
            placement,
            excluded,
            decode,
            lambda w: self._send(w, "POST", path, payload, headers, stream, placement),
        )

    def _salt_for_vllm(self, body: dict[str, Any], tenant: str) -> bool:
        """vLLM workers know no tenants: they get the request's KV salt (the tenant's,
        with the client's ``cache_salt`` folded in) as vLLM's own ``cache_salt``, so tenants
        never share vLLM's prefix cache. True when ``body`` changed."""
        if self.config.worker_engine != "vllm":
            return False
        own = body.get("cache_salt")
        if own is not None and not isinstance(own, str):
            return False  # vLLM answers the malformed field with its own 400
        salt = kv_salt(self.vouch.secret, tenant, own)
        if not salt:
            return False
        body["cache_salt"] = salt
        return True

    def _prefetch_hint(
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
        self._hints.add(task)  # keep a reference until it is done
        task.add_done_callback(self._hints.discard)

    def _peer_hint(self, decode: Worker, placement: Placement) -> dict[str, str]:
        """A turn placed off its session's healthy home names the home, whose KV of the
        conversation the chosen worker then pulls instead of recomputing it (the field to
        add to the body; none otherwise)."""
        home = self.membership.get(placement.home) if placement.home is not None else None
        if home is None or home.url == decode.url or not home.healthy:
            return {}
        self.metrics.kv_peer_hints.inc()
        return {PEER_FIELD: home.url}

    async def models(
        self, client_headers: Mapping[str, str], tenant: str, timeline: Timeline
    ) -> Reply:
        """``GET /v1/models`` from any healthy worker."""
        info = RequestInfo()
        headers = self._forward_headers(client_headers)
        placement = Placement(info, None, timeline=timeline, tenant=tenant)
        timeline.parsed = timeline.handler
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

    def _kv_salt(self, body: dict[str, Any], tenant: str) -> str:
        """The salt the workers hash this request's blocks with: what a builtin worker
        derives from the signed tenant, or what ``_salt_for_vllm`` gave a vLLM one."""
        own = body.get("cache_salt")
        own = own if isinstance(own, str) else None
        if self.config.worker_engine == "vllm":
            return own or ""
        return kv_salt(self.vouch.secret, tenant, own)

    def _place(
        self,
        client_headers: Mapping[str, str],
        body: dict[str, Any],
        timeline: Timeline,
        salt: str = "",
    ) -> Placement:
        key = session_key(client_headers, body, self.config.prefix_chars)
        info = RequestInfo(
            session_key=None if key is None else key.key,
            prefix_key=prefix_key(body, self.config.prefix_chars),
            prompt_tokens=int(disagg.uncached_chars(body, False) / self.config.chars_per_token),
            prompt_token_ids=None if self.tokenizer is None else self.tokenizer.request_ids(body),
            kv_salt=salt,
        )
        home = None
        if info.session_key is not None:
            ring = self._home_ring.sync([w for w in self.membership.all() if w.serves("decode")])
            home = ring.owner(info.session_key)
        return Placement(info, home, timeline=timeline)

    def _place_chain(
        self, placement: Placement, body: dict[str, Any], headers: dict[str, str]
    ) -> None:
        """Key a Responses request by its chain, naming a first turn's new chain to the worker."""
        key, named = chain_key(body)
        headers.update(named)
        placement.info = dataclasses.replace(placement.info, session_key=key.key)
        ring = self._home_ring.sync([w for w in self.membership.all() if w.serves("decode")])
        placement.home = ring.owner(key.key)

    def _predicted(self, worker: Worker, info: RequestInfo) -> tuple[str, int] | None:
        index = getattr(self.policies["decode"], "index", None)  # the kv-events policy's
        if index is None or not info.prompt_token_ids:
            return None
        matched = index.matches([worker.url], info.prompt_token_ids, info.kv_salt)
        return worker.url, matched[worker.url]

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
        send: Callable[[Worker], Awaitable[Reply]],
    ) -> Reply:
        worker: Worker | None = first
        errors: list[str] = []
        redialled = False
        for attempt in range(self.config.max_retries + 1):
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
            self.policies[role].on_request_complete(worker, placement.info)

        try:
            signed = self.vouch.headers(headers, placement.tenant, method, path, payload)
            upstream = await self.client.request(method, worker.url, path, signed, payload)
            timeline = placement.timeline
            headers_at = now()
            self.metrics.latency.observe(headers_at - started)
            if upstream.status >= 500:
                raise WorkerFailed(f"HTTP {upstream.status}")
            if not stream or upstream.status >= 400:
                content = await upstream.read()
                self._succeeded(worker, role, placement)
                await close_once()
                if timeline is not None:
                    timeline.headers, timeline.upstream_first = headers_at, now()
                return Buffered(
                    upstream.status,
                    self._headers(upstream, worker, placement, headers),
                    content,
                    placement.info.session_key,
                )
            first = await upstream.piece()
            if not first:
                raise WorkerFailed("the stream ended before its first byte")
            if timeline is not None:
                timeline.headers, timeline.upstream_first = headers_at, now()
        except (UpstreamError, WorkerFailed) as e:
            await close_once()
            self._failed(worker, role, e)
            if isinstance(e, WorkerFailed):
                raise
            raise WorkerFailed(str(e), dropped=upstream is None and dropped(e)) from e
        self._succeeded(worker, role, placement)
        return Streamed(
            upstream.status,
            self._headers(upstream, worker, placement, headers),
            Leg(first, upstream, placement.relay),
            lambda failure: self._after(failure, worker, placement),
            close_once,
            placement.info.session_key,
        )

    async def _after(
        self, failure: Exception, worker: Worker, placement: Placement
    ) -> AsyncIterator[bytes]:
        """What the client gets when the first leg broke after its first byte: the client
        already has part of the answer, so it is resumed elsewhere, not retried."""
        self._failed(worker, "decode", failure)
        self.metrics.midstream_failures.inc()
        if placement.relay is None:  # relayed as it was: nothing to resume from
            yield _error_event("the decode worker failed mid-stream")
            return
        async for out in self._migrate(placement):
            yield out

    async def _migrate(self, placement: Placement) -> AsyncIterator[bytes]:
        """Continue a broken stream on the session's next decode workers, one leg each."""
        relay, excluded = placement.relay, placement.excluded
        assert relay is not None and excluded is not None
        if relay.log.finish_reason is not None:  # only the usage and [DONE] were lost
            for out in relay.finish_locally():
                yield out
            return
        for _ in range(self.config.max_retries + 1):
            worker = self._pick("decode", placement.info, excluded) if relay.log.resumable else None
            if worker is None:
                break
            self.metrics.migrations.inc()
            log.warning("resuming a stream on %s", worker.url)
            try:
                remaining = relay.remaining(await self._max_model_len(worker, relay.log, placement))
                if remaining <= 0:
                    for out in relay.finish_locally():
                        yield out
                    return
                payload = json.dumps(relay.resume_body(remaining)).encode()
                async with self._leg(worker, payload, placement) as upstream:
                    # SSE comments are ignored by clients; this one helps debugging and tests.
                    yield f": splitserve migrated to {worker.url}\n\n".encode()
                    async for out in relay.relay(_pieces(upstream)):
                        yield out
                return
            except (UpstreamError, IncompleteStream, ValueError, WorkerFailed) as e:
                self._failed(worker, "decode", e)
        yield _error_event("the decode worker failed mid-stream and no worker could resume it")

    @asynccontextmanager
    async def _leg(
        self, worker: Worker, payload: bytes, placement: Placement
    ) -> AsyncIterator[Response]:
        """One resumed leg's upstream stream, counted in the worker's load while it runs."""
        self.metrics.sent(worker.url, "decode")
        worker.in_flight += 1
        try:
            assert placement.headers is not None
            path = "/v1/completions"
            headers = self.vouch.headers(placement.headers, placement.tenant, "POST", path, payload)
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
            self.policies["decode"].on_request_complete(worker, placement.info)

    async def _max_model_len(
        self, worker: Worker, stream: StreamLog, placement: Placement
    ) -> int | None:
        """The worker's context length, needed only when the client set no ``max_tokens``."""
        if stream.max_tokens is not None:
            return None
        assert placement.headers is not None
        path = "/v1/models"
        headers = self.vouch.headers(placement.headers, placement.tenant, "GET", path, None)
        r = await self.client.request("GET", worker.url, path, headers)
        try:
            body = await r.read()
        finally:
            r.release()
        if r.status != 200:
            raise WorkerFailed(f"HTTP {r.status} from /v1/models")
        return int(json.loads(body)["data"][0]["max_model_len"])

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
        self.metrics.sent(worker.url, "prefill")
        params = None
        try:
            signed = self.vouch.headers(headers, placement.tenant, "POST", path, payload)
            r = await self.client.request("POST", worker.url, path, signed, payload)
            try:
                answer = await r.read()
            finally:
                r.release()
            if r.status >= 500:
                raise WorkerFailed(f"HTTP {r.status}")
            params = disagg.accepted_params(json.loads(answer)) if r.status == 200 else None
        except (UpstreamError, ValueError, WorkerFailed) as e:
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
        self.metrics.failed(worker.url, role)
        self.membership.report(worker.url, ok=False)

    def _forward_headers(self, client_headers: Mapping[str, str]) -> dict[str, str]:
        request_id = client_headers.get("x-request-id")
        headers = {
            "content-type": "application/json",
            "x-request-id": _header_value(request_id) if request_id else os.urandom(16).hex(),
        }
        auth = (
            f"Bearer {self.config.worker_api_key}"
            if self.config.worker_api_key
            else client_headers.get("authorization")
        )
        if auth:
            headers["authorization"] = _header_value(auth)
        if session := client_headers.get(SESSION_HEADER):  # workers own KV by session
            headers[SESSION_HEADER] = _header_value(session)
        return headers

    def _headers(
        self, upstream: Response, worker: Worker, placement: Placement, sent: dict[str, str]
    ) -> dict[str, str]:
        out = {k: upstream.headers[k] for k in _PASSED_RESPONSE_HEADERS if k in upstream.headers}
        out["x-request-id"] = sent["x-request-id"]
        out[DECODE_HEADER] = worker.url
        # Predicted from the request's own salted chain: only its tenant's blocks count.
        predicted = placement.predicted
        if predicted is not None and predicted[0] == worker.url:
            out[PREDICTED_HEADER] = str(predicted[1])
        if placement.prefill is not None:
            out[PREFILL_HEADER] = placement.prefill.url
        return out


async def _pieces(response: Response) -> AsyncIterator[bytes]:
    while piece := await response.piece():
        yield piece


def _header_value(value: str) -> str:
    """A client's header value to forward; the upstream client writes values as they are."""
    if "\r" in value or "\n" in value or "\0" in value:
        raise RouterError(400, "a header value has a line break or a NUL")
    return value


def _error_event(message: str) -> bytes:
    error = {"message": message, "type": "server_error", "param": None, "code": "worker_failed"}
    return f"data: {json.dumps({'error': error})}\n\n".encode()
