"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``: the OpenAI Responses
API over the worker's engine, with the conversation of each response chain stored here.

A chain is one session: every response of it runs as session ``response-chain-<chain>``
(``common.responses_api``), so its KV is owned, pinned and erased as that session's. A reply
that calls tools pins the chain's KV in the device pool (``kv_api.tool_call_pin``) until the
call's output comes back in the next turn. A new chain is named by the router
(``x-splitserve-response-chain``) so that it can route the chain's later turns to this
worker; a client talking to the worker directly gets a fresh one. The header is not signed:
naming a chain only chooses a name within the caller's own tenant, whose store, KV salt and
owner records are its own.

A streamed response whose worker died mid-stream is continued here when the router sends
it again with ``resume`` (``ResponsesResume``): its output so far is replayed as for chat
(``worker/resume.py``), the response keeps the id and ``created_at`` the client has (the id
must be of the request's chain) and is stored under it, and its stream goes on from the
client's last event (``response_events``).

``previous_response_id`` naming no response of this tenant is a 400 with code
``previous_response_not_found``, as OpenAI answers it; ``GET``/``DELETE`` of an unknown id
is a 404. ``DELETE`` erases the chain's KV here (``worker.erasure``) even when the response
itself is not stored on this worker: the router asks every worker, as for a session.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from splitserve.common.protocol import ChatCompletionRequest
from splitserve.common.responses_api import (
    CHAIN_HEADER,
    RESPONSES_PATH,
    ResponsesRequest,
    ResponsesResume,
    chain_of,
    chain_session,
    is_chain,
    new_chain,
    response_id,
    response_object,
    usage,
)
from splitserve.engine.outputs import RequestOutput
from splitserve.worker.async_engine import AsyncEngine, EngineError
from splitserve.worker.auth import WorkerAuth
from splitserve.worker.disconnect import ClientGone, unless_disconnected
from splitserve.worker.engine_calls import add_request, kv_blocks, note_usage
from splitserve.worker.erasure import _erase, tenant_of
from splitserve.worker.errors import APIError, bad_request
from splitserve.worker.kv_api import KVSides, kv_transfer, tool_call_pin
from splitserve.worker.kv_owners import KVOwners, OwnedStream
from splitserve.worker.metrics import WorkerMetrics
from splitserve.worker.prepare import EngineInput, ModelInfo, model_not_found, parse_body
from splitserve.worker.quotas import CountedStream, admit
from splitserve.worker.response_events import (
    ResumedStream,
    output_items,
    released,
    response_events,
    status_of,
)
from splitserve.worker.response_input import (
    chat_request,
    engine_input,
    input_messages,
    validation_error,
)
from splitserve.worker.response_store import ResponseStore, StoredResponse
from splitserve.worker.responses import SSEResponse, collect
from splitserve.worker.resume import resumed_input


class _AnyObject(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Turn:
    """One ``POST /v1/responses`` being served: its request, chain and conversation."""

    def __init__(self, req: ResponsesRequest, chain: str, context: list[dict[str, Any]]):
        self.req = req
        self.chain = chain
        self.id = response_id(chain)
        self.session = chain_session(chain)
        self.context = context  # the conversation before this turn's output
        self.created_at = int(time.time())
        self.tools = bool(req.tools) and req.tool_choice != "none"
        self.chat: ChatCompletionRequest | None = None  # the request as chat (``chat_request``)

    def resume(self, resume: ResponsesResume) -> None:
        """Go on as the response another worker began (a 400 if it is not of this chain)."""
        if not self.req.stream:
            raise bad_request("a resumed response streams", param="stream")
        if chain_of(resume.response_id) != self.chain:
            raise bad_request(
                "resume.response_id must be a response id of this request's chain",
                param="resume.response_id",
            )
        self.id, self.created_at = resume.response_id, resume.created_at

    def messages(self) -> list[dict[str, Any]]:
        system = [{"role": "system", "content": self.req.instructions}]
        return (system if self.req.instructions else []) + self.context


def responses_routes(
    async_engine: AsyncEngine,
    metrics: WorkerMetrics,
    model: ModelInfo,
    kv: KVSides,
    auth: WorkerAuth,
    store: ResponseStore,
    owners: KVOwners | None,
) -> APIRouter:
    router = APIRouter()

    @router.post(RESPONSES_PATH)
    async def create(request: Request) -> Response:
        req = await _parse(request)
        if req.model is not None and req.model != model.name:
            raise model_not_found(req.model)
        turn = _turn(req, request, store)
        if req.resume is not None:
            turn.resume(req.resume)
        turn.chat = chat = chat_request(req, turn.messages())
        inp = resumed_input(chat, engine_input(chat, model), model)
        served = async_engine, metrics, auth, store, owners, kv
        return await _serve(request, turn, inp, model, *served)

    @router.get(RESPONSES_PATH + "/{rid}")
    async def retrieve(rid: str, request: Request) -> dict[str, Any]:
        record = store.get(tenant_of(request), rid)
        if record is None:
            raise _not_found(rid)
        return record.body

    @router.delete(RESPONSES_PATH + "/{rid}")
    async def delete(rid: str, request: Request) -> dict[str, Any]:
        tenant = tenant_of(request)
        chain = chain_of(rid)
        erased = None
        if chain is not None and owners is not None:
            session = chain_session(chain)
            erased = await _erase(owners.claim_session(tenant, session), async_engine, kv)
            owners.forget_session(tenant, session)
        if not store.delete(tenant, rid):
            raise _not_found(rid)
        return {"id": rid, "object": "response", "deleted": True, "kv_erasure": erased}

    return router


async def _parse(request: Request) -> ResponsesRequest:
    body = (await parse_body(request, _AnyObject)).model_dump()
    try:
        return ResponsesRequest.model_validate(body)
    except ValidationError as e:
        raise validation_error(e, None) from e


def _turn(req: ResponsesRequest, request: Request, store: ResponseStore) -> _Turn:
    """The chain this request continues (or starts) and its conversation so far."""
    new = input_messages(req.input)
    if req.previous_response_id is None:
        return _Turn(req, _new_chain(request), new)
    previous = store.get(tenant_of(request), req.previous_response_id)
    if previous is None:
        raise bad_request(
            f"Previous response with id '{req.previous_response_id}' not found.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return _Turn(req, previous.chain, [*previous.context, *new])


def _new_chain(request: Request) -> str:
    named = request.headers.get(CHAIN_HEADER)
    if named is None:
        return new_chain()
    if not is_chain(named):
        raise bad_request(f"{CHAIN_HEADER} must be 32 lower-case hex digits", param=CHAIN_HEADER)
    return named


def _not_found(rid: str) -> APIError:
    return APIError(404, f"Response with id '{rid}' not found.", param="response_id")


async def _serve(
    request: Request,
    turn: _Turn,
    inp: EngineInput,
    model: ModelInfo,
    async_engine: AsyncEngine,
    metrics: WorkerMetrics,
    auth: WorkerAuth,
    store: ResponseStore,
    owners: KVOwners | None,
    kv: KVSides,
) -> Response:
    resumed = _resumed_stream(turn, inp)  # checked before the engine has the request
    request.state.request_id, request.state.session = turn.id, turn.session
    salt = request.state.kv_salt = auth.salt(request, None, inp.prompt_token_ids)
    ticket = admit(
        request.app.state.quotas,
        auth,
        request,
        turn.session,
        kv_blocks(inp, async_engine.engine),
        metrics,
    )
    try:
        assert turn.chat is not None
        # A first turn's remote prefill (the router's, as for chat): the prefill leg keeps
        # the prompt's KV for the decode leg, which pulls it before it runs.
        inp, keep = await kv_transfer(turn.chat, inp, kv, request)
        stream = await add_request(async_engine, turn.id, inp, keep, salt, {})
    except BaseException:
        ticket.release()
        raise
    stream = CountedStream(stream, ticket, len(inp.prompt_token_ids))
    if owners is not None:
        key = owners.begin(tenant_of(request), turn.session, turn.id, salt, inp.prompt_token_ids)
        stream = OwnedStream(stream, owners, key, salt, inp.prompt_token_ids)
    tracker = metrics.track(lambda out: note_usage(request, out))
    pin = None
    if turn.tools and hasattr(async_engine.engine, "retain_prefix"):
        pin = tool_call_pin(async_engine, turn.session, salt)

    async def finish(out: RequestOutput, items: list[dict[str, Any]]) -> dict[str, Any]:
        if pin is not None and any(i["type"] == "function_call" for i in items):
            await pin(out)  # the chain comes back with the call's output
        return _finish(turn, model, out, items, tenant_of(request), store)

    if turn.req.stream:
        head = response_object(
            turn.id, model.name, turn.req, "in_progress", [], None, turn.created_at
        )
        ids = inp.prompt_token_ids if turn.req.return_token_ids else None
        events = response_events(stream, tracker, head, turn.tools, finish, ids, resumed)
        return SSEResponse(events, headers={"Cache-Control": "no-cache"})
    try:
        out = await unless_disconnected(request, collect(stream, tracker))
    except ClientGone:
        return Response(status_code=499)  # nobody is listening; the request was aborted
    except EngineError as e:
        raise APIError(500, str(e)) from e
    body = await finish(out, output_items(out, turn.tools))
    if out.kept_blocks is not None and kv.prefill is not None:  # a prefill leg's answer
        n_prompt = len(out.prompt_token_ids)
        body["kv_transfer_params"] = kv.prefill.grant(turn.id, out.kept_blocks, n_prompt)
    return JSONResponse(body)


def _resumed_stream(turn: _Turn, inp: EngineInput) -> ResumedStream | None:
    resume = turn.req.resume
    if resume is None:
        return None
    assert inp.resumed is not None
    text = inp.resumed.text
    if resume.message_id is None and released(text, turn.tools):
        raise bad_request(
            "resume.message_id must name the open message: the output has released text",
            param="resume.message_id",
        )
    return ResumedStream(resume.sequence_number, resume.message_id, text)


def _finish(
    turn: _Turn,
    model: ModelInfo,
    out: RequestOutput,
    items: list[dict[str, Any]],
    tenant: str,
    store: ResponseStore,
) -> dict[str, Any]:
    """The finished response object, stored with its conversation when ``store`` is on."""
    n_out, n_in = len(out.outputs[0].token_ids), len(out.prompt_token_ids)
    # (A resumed response's cache may have held some of its output too: the prompt's part.)
    used = usage(n_in, min(out.num_cached_tokens, n_in), n_out)
    body = response_object(
        turn.id, model.name, turn.req, status_of(out), items, used, turn.created_at
    )
    if turn.req.store is not False:
        # The reply as the model wrote it (tool-call markup included): the next turn's
        # prompt then repeats this one's tokens and finds them cached.
        reply = {"role": "assistant", "content": out.outputs[0].text}
        context = (*turn.context, reply)
        store.put(tenant, StoredResponse(turn.id, turn.chain, body, context))
    return body
