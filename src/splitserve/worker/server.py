"""The worker's HTTP server: the OpenAI API, ``/health``, ``/load`` and ``/metrics``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from splitserve.common.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    KVPrefetchRequest,
    ModelCard,
    ModelList,
    make_id,
)
from splitserve.common.sampling_params import InvalidParameter
from splitserve.engine.outputs import RequestOutput
from splitserve.worker.async_engine import AsyncEngine, EngineError, EngineLike, QueueFull
from splitserve.worker.disagg import DecodeSide, DisaggConfig, KVLoadFailed, PrefillSide
from splitserve.worker.errors import APIError, bad_request, from_validation_error, install_handlers
from splitserve.worker.metrics import WorkerMetrics
from splitserve.worker.peer import PeerKV, peer_url
from splitserve.worker.prepare import (
    EngineInput,
    ModelInfo,
    chat_input,
    completion_input,
    model_not_found,
    offers_tools,
)
from splitserve.worker.responses import (
    SSEResponse,
    chat_response,
    collect,
    completion_response,
    sse_events,
)
from splitserve.worker.tier_metrics import TierCollector

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
# How long a stopping worker waits for pending KV tier copies and disk writes.
TIER_FLUSH_S = 5.0
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its non-streamed response was ready."""


def create_app(
    engine: EngineLike,
    *,
    api_key: str | None = None,
    max_waiting: int | None = None,
    served_model_name: str | None = None,
    disagg: DisaggConfig | None = None,
) -> FastAPI:
    """A FastAPI app serving ``engine``; the engine thread runs for the app's lifespan.

    ``engine`` needs ``tokenizer``, ``model_id``, ``max_model_len`` and
    ``model_config.vocab_size`` besides the ``EngineLike`` methods.
    """
    model = ModelInfo(
        name=served_model_name or engine.model_id,  # type: ignore[attr-defined]
        tokenizer=engine.tokenizer,  # type: ignore[attr-defined]
        max_model_len=engine.max_model_len,  # type: ignore[attr-defined]
        vocab_size=engine.model_config.vocab_size,  # type: ignore[attr-defined]
    )
    async_engine = AsyncEngine(engine, max_waiting=max_waiting)
    metrics = WorkerMetrics(lambda: async_engine.load)
    kv = _KVSides.build(disagg or DisaggConfig(), engine, async_engine, metrics, api_key)
    if getattr(engine, "tiering", None) is not None:
        TierCollector(engine, metrics.registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        kv.start()
        yield
        await kv.stop()
        async_engine.shutdown()
        close = getattr(engine, "close", None)  # pending KV tier writes land within seconds
        if close is not None and not close(TIER_FLUSH_S):
            log.warning("KV tier writes still pending after %.0fs; dropped", TIER_FLUSH_S)

    app = FastAPI(title="splitserve worker", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    install_handlers(app)
    app.include_router(_open_routes(async_engine, metrics))
    app.include_router(
        _api_routes(async_engine, metrics, model, kv), dependencies=[Depends(_auth(api_key))]
    )
    return app


class _KVSides:
    """The disaggregation halves this worker runs: a prefill worker serves kept KV, a decode
    worker pulls it; a collocated worker with a cluster secret can do both. ``server`` is the
    KV data plane (also a peer-lending decode worker's); ``prefill`` is set only where it
    takes prefill legs."""

    def __init__(
        self,
        server: PrefillSide | None,
        decode: DecodeSide | None,
        peer: PeerKV | None = None,
        prefill_legs: bool = True,
    ) -> None:
        self.server, self.decode, self.peer = server, decode, peer
        self.prefill = server if prefill_legs else None

    @classmethod
    def build(
        cls,
        cfg: DisaggConfig,
        engine: Any,
        calls: AsyncEngine,
        metrics: WorkerMetrics,
        api_key: str | None = None,
    ) -> _KVSides:
        if not cfg.secret:
            return cls(None, None)
        server = PrefillSide(cfg, engine, calls, metrics) if cfg.serves_kv else None
        decode = DecodeSide(cfg, engine, calls, metrics) if cfg.role != "prefill" else None
        peer = None
        if cfg.peer and server is not None and decode is not None:
            peer = PeerKV(cfg, server, decode, calls, metrics, api_key)
        return cls(server, decode, peer, prefill_legs=cfg.role != "decode")

    def start(self) -> None:
        if self.server is not None:
            self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.peer is not None:
            await self.peer.close()

    def leased_blocks(self) -> int:
        return self.server.leases.leased_blocks() if self.server is not None else 0


def _auth(api_key: str | None):
    expected = f"Bearer {api_key}".encode() if api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise APIError(
                401,
                "Incorrect or missing API key; send 'Authorization: Bearer KEY'",
                code="invalid_api_key",
            )

    return check


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
    async_engine: AsyncEngine, metrics: WorkerMetrics, model: ModelInfo, kv: _KVSides
) -> APIRouter:
    router = APIRouter()

    @router.get("/load")
    async def load() -> dict[str, Any]:
        s = async_engine.load
        usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        return {
            "running": s.running,
            "waiting": s.waiting,
            "kv_blocks_used": s.kv_blocks_used,
            "kv_blocks_total": s.kv_blocks_total,
            "kv_usage": usage,
            "kv_blocks_leased": kv.leased_blocks(),
        }

    @router.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model.name, max_model_len=model.max_model_len)])

    @router.post("/v1/kv/prefetch")
    async def prefetch(request: Request) -> dict[str, Any]:
        ids = await _prefetch_ids(request, model)
        engine = async_engine.engine
        if getattr(engine, "prefetch", None) is None:
            return {"object": "kv.prefetch", "blocks": 0}
        try:
            blocks = await async_engine.call(lambda e: e.prefetch(ids))
        except EngineError as e:
            raise APIError(503, str(e), code="engine_unavailable") from e
        return {"object": "kv.prefetch", "blocks": blocks}

    @router.post("/v1/kv/lease")
    async def lease(request: Request) -> dict[str, Any]:
        ids = await _prefetch_ids(request, model)
        if kv.peer is None:
            raise APIError(
                404,
                "this worker does not lend KV to peers (start it with --kv-peer)",
                code="kv_peer_disabled",
            )
        try:
            return await kv.peer.lease(ids)
        except EngineError as e:
            raise APIError(503, str(e), code="engine_unavailable") from e

    @router.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = _check_model(await _parse(request, ChatCompletionRequest), model)
        return await _serve(
            request, req, chat_input(req, model), True, model, async_engine, metrics, kv
        )

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = _check_model(await _parse(request, CompletionRequest), model)
        return await _serve(
            request, req, completion_input(req, model), False, model, async_engine, metrics, kv
        )

    return router


async def _parse(request: Request, schema: type[M]) -> M:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        # Lone surrogates (legal in JSON escapes) would crash the tokenizer's UTF-8 encoder.
        json.dumps(body, ensure_ascii=False).encode()
    except (UnicodeEncodeError, RecursionError, ValueError) as e:
        raise bad_request(f"the request body is not valid UTF-8 text: {e}") from e
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from e


async def _prefetch_ids(request: Request, model: ModelInfo) -> list[int]:
    """The prompt a prefetch hint names: token ids, or a chat or completion request body."""
    hint = await _parse(request, KVPrefetchRequest)
    if hint.prompt_token_ids is not None:
        ids = hint.prompt_token_ids
    elif hint.messages is not None:
        ids = chat_input(await _parse(request, ChatCompletionRequest), model).prompt_token_ids
    elif hint.prompt is not None:
        ids = completion_input(await _parse(request, CompletionRequest), model).prompt_token_ids
    else:
        raise bad_request("name the prompt: prompt_token_ids, messages or prompt")
    if not ids or any(t < 0 or t >= model.vocab_size for t in ids):
        raise bad_request(
            f"prompt_token_ids must be non-empty, each in [0, {model.vocab_size})",
            param="prompt_token_ids",
        )
    return ids


def _retention(req: ChatCompletionRequest | CompletionRequest, request: Request, engine: Any):
    """``add_request`` keywords for the ``kv_retention`` extension (none when absent)."""
    if req.kv_retention is None:
        return {}
    tiers = engine.config.kv_tiers
    ttl = req.kv_retention.ttl_s
    ttl = tiers.retention_ttl_s if ttl is None else ttl
    if ttl > tiers.retention_max_ttl_s:
        raise bad_request(
            f"kv_retention.ttl_s may be at most {tiers.retention_max_ttl_s:g} seconds",
            param="kv_retention.ttl_s",
        )
    return {"retention_s": ttl, "session_id": _session_of(req, request)}


def _session_of(req: ChatCompletionRequest | CompletionRequest, request: Request) -> str | None:
    """The session a request belongs to, for retention quotas: as the router keys it."""
    return request.headers.get("x-session-id") or req.user


def _tool_call_pin(
    async_engine: AsyncEngine, session: str
) -> Callable[[RequestOutput], Awaitable[None]]:
    """What to do when a reply called tools: keep the session's KV pinned in the device pool
    for the default TTL, since the session returns with the tool's result."""

    async def pin(out: RequestOutput) -> None:
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        try:
            await async_engine.call(lambda e: e.retain_prefix(ids, session))
        except EngineError:
            log.warning("could not pin the KV of session %s after its tool calls", session)

    return pin


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
    kv: _KVSides,
) -> Response:
    request_id = make_id("chatcmpl" if chat else "cmpl")
    tools = chat and offers_tools(req)  # type: ignore[arg-type]
    options = _retention(req, request, async_engine.engine)
    on_tool_calls = None
    if tools and hasattr(async_engine.engine, "retain_prefix"):
        on_tool_calls = _tool_call_pin(async_engine, _session_of(req, request) or request_id)
    inp, keep = await _kv_transfer(req, inp, kv)
    try:
        stream = await async_engine.add(
            request_id, inp.prompt_token_ids, inp.params, inp.prompt, keep_blocks=keep, **options
        )
    except QueueFull as e:
        raise APIError(429, f"the server is busy ({e}); retry later", code="queue_full") from e
    except InvalidParameter as e:
        raise bad_request(str(e), param=e.param) from e
    except EngineError as e:
        raise APIError(503, str(e), code="engine_unavailable") from e
    tracker = metrics.track()
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
        )
        return SSEResponse(events, headers={"Cache-Control": "no-cache"})
    try:
        out = await _unless_disconnected(request, collect(stream, tracker))
    except ClientGone:
        return Response(status_code=499)  # nobody is listening; the request was aborted
    except EngineError as e:
        raise APIError(500, str(e)) from e
    params = req.kv_transfer_params
    if out.kept_blocks is not None and kv.prefill is not None:
        params = kv.prefill.grant(request_id, out.kept_blocks, len(out.prompt_token_ids))
    if chat:
        response = chat_response(request_id, model.name, out, params, req.return_token_ids, tools)
        if on_tool_calls and response.choices[0].finish_reason == "tool_calls":
            await on_tool_calls(out)
    else:
        response = completion_response(request_id, model.name, out, params, req.return_token_ids)
    return JSONResponse(response.model_dump())


async def _kv_transfer(
    req: ChatCompletionRequest | CompletionRequest, inp: EngineInput, kv: _KVSides
) -> tuple[EngineInput, bool]:
    """Apply the request's ``kv_transfer_params``: a prefill leg computes one token and keeps
    the KV (returns keep=True); a decode leg first pulls the prompt's KV from the prefill
    worker. Without them, a turn naming a ``kv_peer`` first pulls what that peer holds of
    the prompt's KV. Without either, nothing changes."""
    peer = _peer_hint(req)
    params = req.kv_transfer_params or {}
    if params.get("do_remote_decode"):
        if kv.prefill is None:
            raise bad_request(
                "this worker does not serve remote decodes (it is not a prefill worker "
                "with a cluster secret)",
                param="kv_transfer_params",
            )
        if req.stream:
            raise bad_request("a prefill leg cannot stream", param="stream")
        one = dataclasses.replace(inp.params, max_tokens=1)
        return dataclasses.replace(inp, params=one), True
    if params.get("do_remote_prefill"):
        await _import_prefill(params, inp, kv)
    elif peer is not None and kv.peer is not None:
        # A worker without the feature ignores the hint: it is only ever a shortcut.
        await kv.peer.fetch(inp.prompt_token_ids, peer)
    return inp, False


async def _import_prefill(params: dict[str, Any], inp: EngineInput, kv: _KVSides) -> None:
    """A decode leg: pull the prompt's KV from the prefill worker that computed it."""
    if kv.decode is None:
        raise bad_request(
            "this worker cannot load remote KV (it has no cluster secret)",
            param="kv_transfer_params",
        )
    try:
        await kv.decode.import_kv(inp.prompt_token_ids, dict(params))
    except ValueError as e:
        raise bad_request(str(e), param="kv_transfer_params") from e
    except KVLoadFailed as e:
        raise APIError(502, str(e), code="kv_load_failed") from e


def _peer_hint(req: ChatCompletionRequest | CompletionRequest) -> str | None:
    """The home worker a moved turn names (``kv_peer``), checked."""
    if req.kv_peer is None:
        return None
    try:
        return peer_url(req.kv_peer)
    except ValueError as e:
        raise bad_request(str(e), param="kv_peer") from e


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it (which aborts the request) if the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
