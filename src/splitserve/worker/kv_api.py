"""The KV side of the worker's API: the disaggregation halves a worker runs, the prefetch and
lease routes, a request's KV transfer (a prefill leg, a decode leg's pull, a moved turn's
peer fetch), and KV retention for sessions that call tools."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request

from splitserve.common.protocol import ChatCompletionRequest, CompletionRequest, KVPrefetchRequest
from splitserve.engine.outputs import RequestOutput
from splitserve.worker.async_engine import AsyncEngine, EngineError
from splitserve.worker.auth import WorkerAuth
from splitserve.worker.disagg import (
    DecodeSide,
    DisaggConfig,
    ImportResult,
    KVLoadFailed,
    PrefillSide,
)
from splitserve.worker.errors import APIError, bad_request
from splitserve.worker.metrics import WorkerMetrics
from splitserve.worker.peer import PeerKV, peer_url
from splitserve.worker.prepare import (
    EngineInput,
    ModelInfo,
    chat_input,
    completion_input,
    parse_body,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


class KVSides:
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
        auth: WorkerAuth,
    ) -> KVSides:
        if not cfg.secret:
            return cls(None, None)
        server = PrefillSide(cfg, engine, calls, metrics) if cfg.serves_kv else None
        decode = DecodeSide(cfg, engine, calls, metrics) if cfg.role != "prefill" else None
        peer = None
        if cfg.peer and server is not None and decode is not None:
            peer = PeerKV(cfg, server, decode, calls, metrics, auth)
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


def kv_routes(
    async_engine: AsyncEngine, model: ModelInfo, kv: KVSides, auth: WorkerAuth
) -> APIRouter:
    """``/v1/kv/prefetch`` (promote a prompt's KV from lower tiers) and ``/v1/kv/lease``
    (lend a prompt's cached KV to a peer)."""
    router = APIRouter()

    @router.post("/v1/kv/prefetch")
    async def prefetch(request: Request) -> dict[str, Any]:
        ids, cache_salt = await prefetch_ids(request, model)
        if getattr(async_engine.engine, "prefetch", None) is None:
            return {"object": "kv.prefetch", "blocks": 0}
        salt = auth.salt(request, cache_salt, ids)
        blocks = await _engine_answers(async_engine.call(lambda e: e.prefetch(ids, salt)))
        return {"object": "kv.prefetch", "blocks": blocks}

    @router.post("/v1/kv/lease")
    async def lease(request: Request) -> dict[str, Any]:
        ids, cache_salt = await prefetch_ids(request, model)
        if kv.peer is None:
            raise APIError(
                404,
                "this worker does not lend KV to peers (start it with --kv-peer)",
                code="kv_peer_disabled",
            )
        return await _engine_answers(kv.peer.lease(ids, auth.salt(request, cache_salt, ids)))

    return router


async def _engine_answers(work: Awaitable[T]) -> T:
    """``work``'s result; a stopped engine is a 503."""
    try:
        return await work
    except EngineError as e:
        raise APIError(503, str(e), code="engine_unavailable") from e


async def prefetch_ids(request: Request, model: ModelInfo) -> tuple[list[int], str | None]:
    """The prompt a prefetch hint names (token ids, or a chat or completion request body),
    and its ``cache_salt``."""
    hint = await parse_body(request, KVPrefetchRequest)
    if hint.prompt_token_ids is not None:
        ids = hint.prompt_token_ids
    elif hint.messages is not None:
        ids = chat_input(await parse_body(request, ChatCompletionRequest), model).prompt_token_ids
    elif hint.prompt is not None:
        ids = completion_input(await parse_body(request, CompletionRequest), model).prompt_token_ids
    else:
        raise bad_request("name the prompt: prompt_token_ids, messages or prompt")
    if not ids or any(t < 0 or t >= model.vocab_size for t in ids):
        raise bad_request(
            f"prompt_token_ids must be non-empty, each in [0, {model.vocab_size})",
            param="prompt_token_ids",
        )
    return ids, hint.cache_salt


def retention(req: ChatCompletionRequest | CompletionRequest, request: Request, engine: Any):
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
    return {"retention_s": ttl, "session_id": session_of(req, request)}


def session_of(req: ChatCompletionRequest | CompletionRequest, request: Request) -> str | None:
    """The session a request belongs to, for retention quotas: as the router keys it."""
    return request.headers.get("x-session-id") or req.user


def tool_call_pin(
    async_engine: AsyncEngine, session: str, salt: str = ""
) -> Callable[[RequestOutput], Awaitable[None]]:
    """What to do when a reply called tools: keep the session's KV pinned in the device pool
    for the default TTL, since the session returns with the tool's result."""

    async def pin(out: RequestOutput) -> None:
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        try:
            await async_engine.call(lambda e: e.retain_prefix(ids, session, salt=salt))
        except EngineError:
            log.warning("could not pin the KV of session %s after its tool calls", session)

    return pin


async def kv_transfer(
    req: ChatCompletionRequest | CompletionRequest,
    inp: EngineInput,
    kv: KVSides,
    request: Request,
) -> tuple[EngineInput, bool]:
    """Apply the request's ``kv_transfer_params``: a prefill leg computes one token and keeps
    the KV (returns keep=True); a decode leg first pulls the prompt's KV from the prefill
    worker. Without them, a turn naming a ``kv_peer`` first pulls what that peer holds of
    the prompt's KV. Without either, nothing changes. Only a request the router signed may
    carry either: they make this worker contact other hosts."""
    _only_signed(req, request)
    peer = _peer_hint(req)
    params = req.kv_transfer_params or {}
    salt, principal = request.state.kv_salt, request.state.principal
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
        imported = await _import_prefill(params, inp, kv, salt)
        request.state.kv_blocks_received = imported.blocks  # for the access log
    elif peer is not None and kv.peer is not None:
        # A worker without the feature ignores the hint: it is only ever a shortcut.
        outcome = await kv.peer.fetch(inp.prompt_token_ids, peer, principal, req.cache_salt, salt)
        request.state.kv_peer_fetch = outcome
    return inp, False


def _only_signed(req: ChatCompletionRequest | CompletionRequest, request: Request) -> None:
    if request.state.signed:
        return
    for name in ("kv_peer", "kv_transfer_params"):
        if getattr(req, name):
            raise bad_request(
                f"{name} may only be set by the router (a signed request)", param=name
            )


async def _import_prefill(
    params: dict[str, Any], inp: EngineInput, kv: KVSides, salt: str
) -> ImportResult:
    """A decode leg: pull the prompt's KV from the prefill worker that computed it."""
    if kv.decode is None:
        raise bad_request(
            "this worker cannot load remote KV (it has no cluster secret)",
            param="kv_transfer_params",
        )
    try:
        return await kv.decode.import_kv(inp.prompt_token_ids, dict(params), salt)
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
