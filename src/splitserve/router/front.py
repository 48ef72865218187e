"""The OpenAI endpoints as plain ASGI, in front of the router's FastAPI app.

Every proxied request and every streamed chunk passes through here, so the endpoints skip
FastAPI's routing, dependency injection, ``Request`` objects and middleware layers; the
FastAPI app keeps everything else (``/health``, ``/metrics``, membership) and routes the
same paths to the same endpoint, so other methods, trailing slashes and errors answer as
they always did. Cost per request: ``benchmarks/router_overhead.py``, docs/benchmarks.md.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

import orjson

from splitserve.common.access_log import AccessLog, usage_fields, wall_clock
from splitserve.common.quotas import Quotas
from splitserve.common.tenants import Key, Tenant, Tenants
from splitserve.router.admission import Admission, capped
from splitserve.router.errors import RouterError
from splitserve.router.metrics import RouterMetrics
from splitserve.router.proxy import DECODE_HEADER, PREFILL_HEADER, Proxy
from splitserve.router.replies import Buffered, Reply, write
from splitserve.router.timing import Timeline, now

COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
MODELS_PATH = "/v1/models"
ROUTES = {("POST", p) for p in COMPLETION_PATHS} | {("GET", MODELS_PATH)}


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


def check_bearer(expected: bytes | None, given: str, what: str) -> None:
    """Raise a 401 unless ``given`` (an Authorization header) is ``expected``."""
    if expected is not None and not hmac.compare_digest(given.encode(), expected):
        raise unauthorized(what)


def unauthorized(what: str) -> RouterError:
    return RouterError(
        401,
        f"Incorrect or missing {what}; send 'Authorization: Bearer KEY'",
        code="invalid_api_key",
    )


def caller_tenant(tenants: Tenants, authorization: str) -> str:
    """The tenant the caller's ``Authorization`` header names, or a 401."""
    tenant = tenants.authenticate(authorization)
    if tenant is None:
        raise unauthorized("API key")
    return tenant.id


class Endpoint:
    """The OpenAI endpoints' ASGI app (also mounted in the FastAPI app under their paths)."""

    def __init__(
        self,
        proxy: Callable[[], Proxy],
        metrics: RouterMetrics,
        tenants: Tenants,
        access_log: AccessLog | None = None,
    ) -> None:
        self.proxy = proxy  # created with the HTTP pool when the app starts
        self.metrics = metrics
        self.tenants = tenants
        self.quotas = Quotas()
        self.access_log = access_log

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        timeline = Timeline.of(scope)
        tenant = None
        try:
            headers = _headers(scope)
            key = self.tenants.identify(headers.get("authorization", ""))
            if key is None:
                raise unauthorized("API key")
            tenant = key.tenant
            admission = Admission(self.quotas, tenant, self.metrics) if capped(tenant) else None
            reply = await self._answer(scope, receive, headers, key, timeline, admission)
        except RouterError as e:
            await e.response()(scope, receive, send)
            if self.access_log is not None:
                self._log(scope, timeline, tenant, e.status)
            return
        except ClientGone:
            if self.access_log is not None:
                self._log(scope, timeline, tenant, 499)
            return
        try:
            await write(reply, scope, receive, send, timeline)
        finally:
            if admission is not None:
                admission.release()
        self.metrics.timeline(timeline)
        if self.access_log is not None:
            self._log(scope, timeline, tenant, reply.status, reply)

    def _log(
        self,
        scope: dict,
        timeline: Timeline,
        tenant: Tenant | None,
        status: int,
        reply: Reply | None = None,
    ) -> None:
        """The request's access log line; the usage only of a buffered answer (a stream's
        usage chunk is relayed unparsed)."""
        assert self.access_log is not None
        headers, workers, usage = _headers(scope), None, None
        if reply is not None:
            headers = reply.headers
            workers = [headers[h] for h in (DECODE_HEADER, PREFILL_HEADER) if h in headers]
        if isinstance(reply, Buffered) and reply.status == 200 and scope["path"] != MODELS_PATH:
            usage = _usage(reply.content)
        self.access_log.write(
            arrived=wall_clock(timeline.received),
            server="router",
            method=scope["method"],
            path=scope["path"],
            status=status,
            latency_s=round(now() - timeline.received, 6),
            tenant=None if tenant is None else tenant.id,
            session=None if reply is None else reply.session,
            request_id=headers.get("x-request-id"),
            workers=workers,
            **usage_fields(usage),
        )

    async def _answer(
        self,
        scope: dict,
        receive: Any,
        headers: dict[str, str],
        key: Key,
        timeline: Timeline,
        admission: Admission | None,
    ) -> Reply:
        # Workers are told the key's principal: whose KV salt its requests hash with.
        if scope["path"] == MODELS_PATH:
            return await self.proxy().models(headers, key.principal, timeline)
        raw = await _body(receive)
        try:
            return await self.proxy().completion(
                headers, raw, scope["path"], key.principal, timeline, admission
            )
        except BaseException:
            if admission is not None:
                admission.release()
            raise


class Front:
    """Sends the OpenAI endpoints' requests straight to ``endpoint``, the rest to ``app``."""

    def __init__(self, app: Any, endpoint: Any) -> None:
        self.app = app
        self.endpoint = endpoint  # an ``Endpoint`` (behind ``BodyLimit``, as the app serves it)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and (scope["method"], scope["path"]) in ROUTES:
            await self.endpoint(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def _headers(scope: dict) -> dict[str, str]:
    """The request's headers by lower-case name; the first of a repeated name wins."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in reversed(scope["headers"])}


def _usage(content: bytes) -> dict[str, Any] | None:
    try:
        return orjson.loads(content).get("usage")
    except (orjson.JSONDecodeError, AttributeError):
        return None


async def _body(receive: Any) -> bytes:
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)
