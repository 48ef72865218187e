"""The worker's HTTP server: the OpenAI API, ``/health``, ``/load`` and ``/metrics`` (the KV
routes and a request's KV transfer: ``worker.kv_api``)."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from splitserve.common import keys_reload, openapi
from splitserve.common.access_log import AccessLog, AccessLogMiddleware
from splitserve.common.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimit
from splitserve.common.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    make_id,
)
from splitserve.common.quotas import Quotas
from splitserve.common.tenants import Tenants
from splitserve.worker.async_engine import AsyncEngine, EngineError, EngineLike
from splitserve.worker.auth import WorkerAuth
from splitserve.worker.choices import (
    ChoiceStreams,
    ChoiceTrackers,
    choice_id,
    choice_params,
)
from splitserve.worker.disagg_config import DisaggConfig
from splitserve.worker.disconnect import ClientGone, unless_disconnected
from splitserve.worker.engine_calls import add_request, kv_blocks, note_usage
from splitserve.worker.erasure import erasure_routes, own_stream
from splitserve.worker.errors import APIError, bad_request, install_handlers
from splitserve.worker.kv_api import (
    KVSides,
    kv_routes,
    kv_transfer,
    retention,
    session_of,
    tool_call_pin,
)
from splitserve.worker.kv_owners import owners_for
from splitserve.worker.logprobs import LogprobFormatter
from splitserve.worker.metrics import WorkerMetrics
from splitserve.worker.prepare import (
    EngineInput,
    M,
    ModelInfo,
    chat_input,
    completion_input,
    model_not_found,
    offers_tools,
    parse_body,
)
from splitserve.worker.quotas import CountedStream, admit
from splitserve.worker.response_store import DEFAULT_MAX_PER_TENANT, ResponseStore
from splitserve.worker.responses import (
    SSEResponse,
    chat_response,
    collect_choices,
    completion_response,
    sse_events,
)
from splitserve.worker.responses_api import responses_routes
from splitserve.worker.resume import resumed_input
from splitserve.worker.saved_responses import SavedResponses
from splitserve.worker.tier_metrics import TierCollector

log = logging.getLogger(__name__)
# How long a stopping worker waits for pending KV tier copies and disk writes.
TIER_FLUSH_S = 5.0


def create_app(
    engine: EngineLike,
    *,
    api_key: str | None = None,
    tenants: Tenants | None = None,
    max_waiting: int | None = None,
    served_model_name: str | None = None,
    disagg: DisaggConfig | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    access_log: AccessLog | None = None,
) -> FastAPI:
    """A FastAPI app serving ``engine``; the engine thread runs for the app's lifespan.

    ``engine`` needs ``tokenizer``, ``model_id``, ``max_model_len`` and
    ``model_config.vocab_size`` besides the ``EngineLike`` methods. Clients authenticate
    with ``tenants``' keys (default: ``api_key`` alone, or none). ``access_log``: a line per
    ``/v1/`` request (closed when the app stops).
    """
    model = ModelInfo(
        name=served_model_name or engine.model_id,  # type: ignore[attr-defined]
        tokenizer=engine.tokenizer,  # type: ignore[attr-defined]
        max_model_len=engine.max_model_len,  # type: ignore[attr-defined]
        vocab_size=engine.model_config.vocab_size,  # type: ignore[attr-defined]
    )
    async_engine = AsyncEngine(engine, max_waiting=max_waiting)
    metrics = WorkerMetrics(lambda: async_engine.load)
    async_engine.on_step = metrics.step
    disagg = disagg or DisaggConfig()
    auth = WorkerAuth.for_model(
        tenants or Tenants.from_args(api_key, None), disagg.secret, model.tokenizer
    )
    kv = KVSides.build(disagg, engine, async_engine, metrics, auth)
    if getattr(engine, "tiering", None) is not None:
        TierCollector(engine, metrics.registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        kv.start()
        reload = keys_reload.start(auth.salts)
        yield
        await keys_reload.stop(reload)
        await kv.stop()
        async_engine.shutdown()
        close = getattr(engine, "close", None)  # pending KV tier writes land within seconds
        if close is not None and not close(TIER_FLUSH_S):
            log.warning("KV tier writes still pending after %.0fs; dropped", TIER_FLUSH_S)
        if access_log is not None:
            access_log.close()

    app = FastAPI(title="splitserve worker", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.state.quotas = Quotas()
    install_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.state.in_flight = InFlight()
    app.add_middleware(CountPosts, in_flight=app.state.in_flight)
    if access_log is not None:  # outside the body limit: a 413 is logged too
        app.add_middleware(AccessLogMiddleware, log=access_log, server="worker")
    app.include_router(_open_routes(async_engine, metrics))
    guard = [Depends(auth)]
    app.include_router(_api_routes(async_engine, metrics, model, kv, auth), dependencies=guard)
    app.include_router(kv_routes(async_engine, model, kv, auth), dependencies=guard)
    app.state.kv_owners = owners_for(engine)
    app.include_router(erasure_routes(async_engine, kv, app.state.kv_owners), dependencies=guard)
    app.state.responses = _response_store(engine)
    responses = responses_routes(
        async_engine, metrics, model, kv, auth, app.state.responses, app.state.kv_owners
    )
    app.include_router(responses, dependencies=guard)
    openapi.install(app, openapi.worker_operations("bearer" if auth.tenants.required else None))
    return app


def _response_store(engine: EngineLike) -> ResponseStore:
    """The stored responses: on disk too when the engine has a disk KV tier, so a response
    chain survives a restart with its KV (``saved_responses``)."""
    tiers = getattr(engine, "kv_tiers", None)
    disk = tiers.ladder.disk() if tiers is not None else None
    if disk is None:
        return ResponseStore()
    saved = SavedResponses(disk.directory, DEFAULT_MAX_PER_TENANT, disk.ring)
    return ResponseStore(DEFAULT_MAX_PER_TENANT, saved)


class InFlight:
    count = 0


class CountPosts:
    """ASGI middleware: how many POST requests the worker is answering (a stream until its
    last byte), for ``/load``. A request still being parsed, or already out of the engine but
    not yet answered, counts too: a worker being drained is idle only once this is 0."""

    def __init__(self, app: Any, in_flight: InFlight) -> None:
        self.app, self.in_flight = app, in_flight

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        self.in_flight.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight.count -= 1


def _open_routes(async_engine: AsyncEngine, metrics: WorkerMetrics) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> JSONResponse:
        if not async_engine.alive:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @router.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return router


def _api_routes(
    async_engine: AsyncEngine,
    metrics: WorkerMetrics,
    model: ModelInfo,
    kv: KVSides,
    auth: WorkerAuth,
) -> APIRouter:
    router = APIRouter()

    @router.get("/load")
    async def load(request: Request) -> dict[str, Any]:
        s = async_engine.load
        usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        return {
            "running": s.running,
            "waiting": s.waiting,
            "requests": request.app.state.in_flight.count,
            "kv_blocks_used": s.kv_blocks_used,
            "kv_blocks_total": s.kv_blocks_total,
            "kv_usage": usage,
            "kv_blocks_leased": kv.leased_blocks(),
        }

    @router.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model.name, max_model_len=model.max_model_len)])

    @router.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = _check_model(await parse_body(request, ChatCompletionRequest), model)
        inp = chat_input(req, model)
        return await _serve(request, req, inp, True, model, async_engine, metrics, kv, auth)

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = _check_model(await parse_body(request, CompletionRequest), model)
        inp = completion_input(req, model)
        return await _serve(request, req, inp, False, model, async_engine, metrics, kv, auth)

    return router


def _check_model(req: M, model: ModelInfo) -> M:
    name = req.model  # type: ignore[attr-defined]
    if name is not None and name != model.name:
        raise model_not_found(name)
    return req


async def _serve(
    request: Request,
    req: ChatCompletionRequest | CompletionRequest,
    inp: EngineInput,
    chat: bool,
    model: ModelInfo,
    async_engine: AsyncEngine,
    metrics: WorkerMetrics,
    kv: KVSides,
    auth: WorkerAuth,
) -> Response:
    inp = resumed_input(req, inp, model)
    request_id = request.state.request_id = make_id("chatcmpl" if chat else "cmpl")
    request.state.session = session_of(req, request)
    tools = chat and offers_tools(req)  # type: ignore[arg-type]
    salt = request.state.kv_salt = auth.salt(request, req.cache_salt, inp.prompt_token_ids)
    options = retention(req, request, async_engine.engine)
    on_tool_calls = None
    if tools and hasattr(async_engine.engine, "retain_prefix"):
        session = request.state.session or request_id
        on_tool_calls = tool_call_pin(async_engine, session, salt)
    n = req.n or 1
    blocks = kv_blocks(inp, async_engine.engine, n)
    quotas = request.app.state.quotas
    ticket = admit(quotas, auth, request, session_of(req, request), blocks, metrics)
    try:
        inp, keep = await kv_transfer(req, inp, kv, request)
        if n > 1:
            if keep:
                raise bad_request("a prefill leg (do_remote_decode) must have n=1", param="n")
            stream = await _add_choices(
                request, req, request_id, inp, salt, options, n, async_engine
            )
        else:
            stream = await add_request(async_engine, request_id, inp, keep, salt, options)
    except BaseException:
        ticket.release()
        raise
    stream = CountedStream(stream, ticket, len(inp.prompt_token_ids))
    if n == 1:
        stream = own_stream(request, req, request_id, inp.prompt_token_ids, stream)
        tracker = metrics.track(lambda out: note_usage(request, out))
    else:
        tracker = ChoiceTrackers(lambda: metrics.track(lambda out: note_usage(request, out)), n)
    logprobs = LogprobFormatter(model.tokenizer) if inp.params.logprobs is not None else None
    parallel = getattr(req, "parallel_tool_calls", None) is not False
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        prompt_ids = inp.prompt_token_ids if req.return_token_ids else None
        events = sse_events(
            stream,
            tracker,
            request_id,
            model.name,
            chat,
            include_usage,
            prompt_ids,
            tools,
            on_tool_calls,
            logprobs,
            parallel,
            n,
            resumed=inp.resumed_choices or (inp.resumed and (inp.resumed,)),
        )
        return SSEResponse(events, headers={"Cache-Control": "no-cache"})
    try:
        outs = await unless_disconnected(request, collect_choices(stream, tracker, n))
    except ClientGone:
        return Response(status_code=499)  # nobody is listening; the request was aborted
    except EngineError as e:
        raise APIError(500, str(e)) from e
    params = req.kv_transfer_params
    out = outs[0]
    if out.kept_blocks is not None and kv.prefill is not None:
        params = kv.prefill.grant(request_id, out.kept_blocks, len(out.prompt_token_ids))
    if chat:
        response = chat_response(
            request_id,
            model.name,
            outs,
            params,
            req.return_token_ids,
            tools,
            logprobs,
            parallel,
        )
        reasons = [c.finish_reason for c in response.choices]
        if on_tool_calls and "tool_calls" in reasons:
            await on_tool_calls(outs[reasons.index("tool_calls")])
    else:
        response = completion_response(
            request_id, model.name, outs, params, req.return_token_ids, logprobs
        )
    return JSONResponse(response.model_dump())


async def _add_choices(
    request: Request,
    req: ChatCompletionRequest | CompletionRequest,
    request_id: str,
    inp: EngineInput,
    salt: str,
    options: dict[str, Any],
    n: int,
    async_engine: AsyncEngine,
) -> ChoiceStreams:
    """The request's ``n`` choices, each an engine request of its own; choices 1..n-1 are
    added once choice 0 has computed the prompt, so they take its blocks from the cache
    (a resumed request's choices that had ended are not run again)."""
    choices = ChoiceStreams(n)
    resumed = inp.resumed_choices
    try:
        for i in range(n):
            if resumed is not None and resumed[i].finish_reason is not None:
                continue  # it had ended on the worker that began the request
            if choices.n_added == 1 and not await choices.first_output():
                break  # the first choice failed: iterating the choices raises its error
            params = choice_params(inp.params, i)
            choice = replace(inp, params=params, resumed=resumed and resumed[i])
            rid = choice_id(request_id, i)
            stream = await add_request(async_engine, rid, choice, False, salt, options)
            choices.add(own_stream(request, req, rid, inp.prompt_token_ids, stream), i)
    except BaseException:
        choices.close()
        raise
    return choices
