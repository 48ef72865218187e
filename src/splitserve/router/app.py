"""The router's HTTP front: the OpenAI endpoints, membership, ``/health`` and ``/metrics``."""

from __future__ import annotations

import re
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from splitserve.common import keys_reload
from splitserve.common.access_log import AccessLog
from splitserve.common.body_limit import BodyLimit
from splitserve.common.kv_events import SOURCE_RE
from splitserve.common.kv_salts import KVSalts
from splitserve.common.tenants import DEFAULT_TENANT, Tenants
from splitserve.router import api_schema, upstream
from splitserve.router.config import RouterConfig
from splitserve.router.erasure import erasure_routes
from splitserve.router.errors import RouterError
from splitserve.router.front import COMPLETION_PATHS, MODELS_PATH, Endpoint, Front, check_bearer
from splitserve.router.health import HealthChecker
from splitserve.router.kv_index import KVEventSubscriber, KVIndex
from splitserve.router.membership import BreakerConfig, Membership
from splitserve.router.metrics import RouterMetrics
from splitserve.router.policies import make_policy
from splitserve.router.proxy import Proxy
from splitserve.router.responses_api import responses_routes
from splitserve.router.ring import DEFAULT_VNODES
from splitserve.router.vouch import Vouch
from splitserve.router.worker import ROLES, Worker, check_url, healthy_workers, normalize_url


def create_app(config: RouterConfig) -> Front:
    """A router app over ``config``'s workers; probes and the HTTP pool live with the app.

    The OpenAI endpoints are plain ASGI (``front``); the rest is a FastAPI app behind them.
    """
    membership = Membership(
        config.initial_workers(), BreakerConfig(config.failure_threshold, config.cooldown_s)
    )
    metrics = RouterMetrics(
        lambda role: sum(w.role == role for w in healthy_workers(membership.all()))
    )
    state: dict[str, Any] = {}
    tenants = _tenants(config)
    vouch = Vouch(config.cluster_secret, config.worker_api_key)
    kv_index = KVIndex() if config.kv_events else None
    tokenizer = _tokenizer(config)
    salts = _salts(tenants, config.cluster_secret, tokenizer)
    access_log = None
    if config.access_log is not None:
        access_log = AccessLog(config.access_log, config.access_log_max_bytes)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client = upstream.pool(config)
        probes = upstream.probe_pool(config)
        checker = HealthChecker(
            probes,
            membership.all,
            membership.report,
            config.health_interval_s,
            config.health_timeout_s,
            vouch.probe,
        )
        subscriber = None
        if kv_index is not None:
            subscriber = KVEventSubscriber(kv_index, config.kv_events, config.kv_events_topic)
            subscriber.start()
            app.state.kv_events = subscriber
        state["proxy"] = Proxy(
            config,
            membership,
            _policy(config, config.policy, kv_index),
            _policy(config, config.prefill_policy, kv_index),
            client,
            metrics,
            tokenizer,
            vouch,
            salts,
        )
        checker.start()
        reload = keys_reload.start(salts, _check_secret(config.cluster_secret))
        try:
            yield
        finally:
            await keys_reload.stop(reload)
            if subscriber is not None:
                await subscriber.stop()
            await checker.stop()
            await client.close()
            await probes.close()
            if access_log is not None:
                access_log.close()

    app = FastAPI(title="splitserve router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.membership = membership
    app.state.metrics = metrics
    app.state.kv_index = kv_index
    _install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.include_router(_open_routes(membership, metrics))
    endpoint = Endpoint(lambda: state["proxy"], metrics, tenants, access_log)
    for path in COMPLETION_PATHS:
        app.router.routes.append(Route(path, endpoint, methods=["POST"]))
    app.router.routes.append(Route(MODELS_PATH, endpoint, methods=["GET"]))
    app.include_router(
        _admin_routes(membership, kv_index, metrics), dependencies=[Depends(_admin(config))]
    )
    app.include_router(erasure_routes(lambda: state["proxy"], membership, tenants))
    app.include_router(responses_routes(lambda: state["proxy"], membership, tenants))
    api_schema.install(app, config)
    return Front(app, BodyLimit(endpoint, config.max_body_bytes))


def _tenants(config: RouterConfig) -> Tenants:
    """The clients' keys; tenants other than the default need the cluster secret, since
    that is how the workers learn whose request it is."""
    tenants = Tenants.from_args(config.api_key, config.api_keys_file)
    _check_secret(config.cluster_secret)(tenants)
    return tenants


def _check_secret(secret: bytes) -> Callable[[Tenants], None]:
    def check(tenants: Tenants) -> None:
        if set(tenants.by_id) - {DEFAULT_TENANT} and not secret:
            raise ValueError(
                "tenants need the cluster secret (--kv-secret-file or SPLITSERVE_KV_SECRET) "
                "to tell the workers whose request each one is"
            )

    return check


def _salts(tenants: Tenants, secret: bytes, tokenizer: Any) -> KVSalts:
    """The workers' KV salts; the public prefixes tokenized as the workers do, when the
    router has the model's tokenizer."""
    if tokenizer is None:
        return KVSalts(tenants, secret)
    return KVSalts(tenants, secret, tokenizer.text_ids, lambda m: tokenizer.chat_ids(m))


def _policy(config: RouterConfig, name: str, kv_index: KVIndex | None):
    options: dict[str, Any] = {}
    if name in ("session", "prefix", "kv-events") and config.vnodes != DEFAULT_VNODES:
        options["vnodes"] = config.vnodes
    if name in ("session", "kv-events"):
        options["load_factor"] = config.load_factor
        options["load_floor"] = config.load_floor
    if name == "kv-events":
        options["index"] = kv_index
    return make_policy(name, **options)


def _tokenizer(config: RouterConfig):
    """The router's own tokenizer when one is configured (``--tokenizer``), else None."""
    if config.tokenizer is None:
        return None
    from splitserve.router.prompt_tokens import ChatTokenizer

    return ChatTokenizer.from_dir(config.tokenizer)


def _open_routes(membership: Membership, metrics: RouterMetrics) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> JSONResponse:
        serving = membership.candidates("decode")
        body = {
            "status": "ok" if serving else "no healthy decode worker",
            "healthy_decode_workers": len(serving),
            "workers": len(membership.all()),
        }
        return JSONResponse(body, status_code=200 if serving else 503)

    @router.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return router


def _admin_routes(
    membership: Membership, kv_index: KVIndex | None, metrics: RouterMetrics
) -> APIRouter:
    router = APIRouter()

    @router.get("/workers")
    async def list_workers() -> dict[str, Any]:
        membership.candidates("decode")  # refresh health flags (breaker cool-downs)
        sessions = metrics.sessions_by_worker()
        described = [
            _describe(w, kv_index) | {"sessions": sessions[w.url]} for w in membership.all()
        ]
        return {"workers": described}

    @router.post("/workers")
    async def add_worker(request: Request) -> JSONResponse:
        body = await _body(request)
        worker = _worker_from(body)
        events = _events_endpoint(body, kv_index)
        added = membership.add(worker)
        if events is not None:
            await request.app.state.kv_events.add(worker.url, events)
        return JSONResponse(
            _describe(membership.get(worker.url), kv_index), status_code=201 if added else 200
        )

    @router.delete("/workers/{url:path}")
    async def remove_worker(url: str, request: Request) -> dict[str, Any]:
        try:
            worker = membership.remove(url)
        except ValueError:  # not even a URL (blank): no such worker either
            worker = None
        if worker is None:
            raise RouterError(
                404, f"no worker {url!r} in this router", code="worker_not_found", param="url"
            )
        if kv_index is not None:
            await request.app.state.kv_events.remove(worker.url)
        return {"url": worker.url, "removed": True}

    return router


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as e:
        raise RouterError(400, f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise RouterError(400, "the request body must be a JSON object")
    return body


def _worker_from(body: dict[str, Any]) -> Worker:
    url, role = body.get("url"), body.get("role", "both")
    if not isinstance(url, str) or not url.strip():
        raise RouterError(400, "'url' must be a non-empty string", param="url")
    if role not in ROLES:
        raise RouterError(400, f"'role' must be one of {', '.join(ROLES)}", param="role")
    try:
        return Worker(check_url(normalize_url(url)), role)
    except ValueError as e:
        raise RouterError(400, str(e), param="url") from e


def _events_endpoint(body: dict[str, Any], kv_index: KVIndex | None) -> str | None:
    """A joining worker's ``kv_events`` (``tcp://HOST:PORT``, optionally followed by
    ``,tcp://HOST:PORT`` where it answers replays), for the kv-events policy."""
    endpoint = body.get("kv_events")
    if endpoint is None:
        return None
    if kv_index is None:
        raise RouterError(
            400,
            "'kv_events' needs a router that places by KV events (--policy kv-events)",
            param="kv_events",
        )
    if not isinstance(endpoint, str) or not re.fullmatch(SOURCE_RE, endpoint):
        raise RouterError(
            400, "'kv_events' must be tcp://HOST:PORT[,tcp://HOST:PORT]", param="kv_events"
        )
    return endpoint


def _describe(w: Worker, kv_index: KVIndex | None = None) -> dict[str, Any]:
    out = {
        "url": w.url,
        "role": w.role,
        "healthy": w.healthy,
        "load": w.load,
        "in_flight": w.in_flight,
        "running": w.report.running,
        "waiting": w.report.waiting,
        "kv_blocks_used": w.report.kv_blocks_used,
        "kv_blocks_total": w.report.kv_blocks_total,
    }
    if kv_index is not None:  # the blocks the worker's KV events say it holds
        blocks = kv_index.workers.get(w.url)
        out["kv_blocks_indexed"] = 0 if blocks is None else len(blocks)
    return out


def _admin(config: RouterConfig):
    expected = f"Bearer {config.admin_key}".encode() if config.admin_key else None

    async def guard(request: Request) -> None:
        if config.admin_key is None:
            raise RouterError(
                403,
                "membership endpoints are disabled: start the router with "
                "an admin key (--admin-key or --api-key)",
                code="admin_disabled",
            )
        check_bearer(expected, request.headers.get("authorization", ""), "admin key")

    return guard


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RouterError)
    async def _router_error(request: Request, exc: RouterError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return RouterError(exc.status_code, str(exc.detail)).response()
