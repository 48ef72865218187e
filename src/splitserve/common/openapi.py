"""The OpenAPI schema the worker and the router serve on ``/openapi.json``.

Both parse the OpenAI endpoints' bodies by hand (``worker.prepare.parse_body``,
``router.body``), so FastAPI sees no request model there, and the router serves those
endpoints as plain ASGI, outside FastAPI's routing altogether. ``install`` adds what FastAPI
cannot see to the schema it generates: each operation's request body (the models of
``common.protocol``), its answers (OpenAI-shaped errors among them), and the bearer key where
one is required.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from splitserve.common.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    KVPrefetchRequest,
    ModelList,
)
from splitserve.common.responses_api import ResponsesRequest

_REF = "#/components/schemas/{model}"
# What a client can cause on every endpoint that takes a body; a model's endpoints add more.
_BODY_ERRORS = {
    "400": "the body is not a valid request (not JSON, a field out of range, ...)",
    "413": "the body is larger than the server's limit",
}
# With ``stream: true``: one server-sent event (OpenAPI before 3.2 describes a stream by its
# events), whose data is a chunk of the answer as JSON, or ``[DONE]`` after the last.
_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a chunk as JSON, or [DONE]"}},
}
# A Responses stream's events: ``event:`` names the type, ``data:`` is the event as JSON.
_RESPONSE_EVENT = {
    "type": "object",
    "required": ["event", "data"],
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
}
_LOAD = {
    "type": "object",
    "required": ["running", "waiting", "kv_blocks_used", "kv_blocks_total", "kv_usage"],
}
# Not the client's doing: a stopped engine (worker), no healthy worker (router).
_UNAVAILABLE = {"503": "nothing can serve the request now; retry later"}
_AUTH_ERRORS = {"401": "a key is required and the request's Authorization header is not it"}


@dataclass(slots=True)
class Operation:
    """One operation's additions: its request body's model, answers, whether it needs a key."""

    summary: str
    body: type[BaseModel] | dict[str, Any] | None = None
    _: KW_ONLY
    ok: dict[str, Any] = field(default_factory=dict)  # a success's content, by media type
    ok_statuses: tuple[str, ...] = ("200",)
    errors: dict[str, str] = field(default_factory=dict)  # status -> when
    key: str | None = None  # the security scheme guarding it, if one does


def openai_operations(key: str | None) -> dict[tuple[str, str], Operation]:
    """The OpenAI endpoints, as the worker and the router both serve them."""
    model_errors = {
        **_BODY_ERRORS,
        "404": "the request names another model",
        "429": "the worker's queue is full; retry later",
        **_UNAVAILABLE,
    }

    def completion(summary: str, body: type[BaseModel], answer: type[BaseModel]) -> Operation:
        ok = {
            "application/json": answer,
            "text/event-stream": _EVENT,
        }
        return Operation(summary, body, ok=ok, errors=model_errors, key=key)

    return {
        ("post", "/v1/chat/completions"): completion(
            "Chat completion", ChatCompletionRequest, ChatCompletionResponse
        ),
        ("post", "/v1/completions"): completion(
            "Text completion", CompletionRequest, CompletionResponse
        ),
        ("get", "/v1/models"): Operation(
            "The served model", ok={"application/json": ModelList}, errors=_UNAVAILABLE, key=key
        ),
        **responses_operations(key, model_errors),
    }


def responses_operations(
    key: str | None, errors: dict[str, str]
) -> dict[tuple[str, str], Operation]:
    """The Responses API (``worker.responses_api``); the router asks every worker for a
    stored response and answers 502 when none has it and one could not be asked."""
    ok = {"application/json": {"type": "object"}}
    stored = {"404": "no stored response of the caller's tenant has this id"}
    stored |= {"502": "no worker holds it and some worker could not be asked (router)"}
    path = "/v1/responses/{rid}"
    return {
        ("post", "/v1/responses"): Operation(
            "Create a response (a turn of a response chain)",
            ResponsesRequest,
            ok={**ok, "text/event-stream": _RESPONSE_EVENT},
            errors=errors,
            key=key,
        ),
        ("get", path): Operation("A stored response", ok=ok, errors=stored, key=key),
        ("delete", path): Operation(
            "Delete a stored response and erase its chain's KV", ok=ok, errors=stored, key=key
        ),
    }


def probe_operations() -> dict[tuple[str, str], Operation]:
    """``/health`` and ``/metrics``, open on the worker and the router alike."""
    status = {
        "type": "object",
        "required": ["status"],
        "properties": {"status": {"type": "string"}},
    }
    health = Operation(
        "Serving or not", ok={"application/json": status}, ok_statuses=("200", "503")
    )
    metrics = Operation("Prometheus metrics", ok={"text/plain": {"type": "string"}})
    return {("get", "/health"): health, ("get", "/metrics"): metrics}


def worker_operations(key: str | None) -> dict[tuple[str, str], Operation]:
    """Every route a worker serves (``key``: the scheme guarding all but the probes)."""
    load = Operation("Queue and KV cache usage", ok={"application/json": _LOAD}, key=key)
    ops = {**probe_operations(), **openai_operations(key), **kv_operations(key)}
    ops |= erasure_operations(key)
    return {**ops, ("get", "/load"): load}


def kv_operations(key: str | None) -> dict[tuple[str, str], Operation]:
    """The worker's KV routes; their bodies may also be a chat or text completion request."""
    errors = {**_BODY_ERRORS, "404": "this worker does not lend KV (lease)", **_UNAVAILABLE}
    answer = {"application/json": {"type": "object"}}
    return {
        ("post", path): Operation(summary, KVPrefetchRequest, ok=answer, errors=errors, key=key)
        for path, summary in (
            ("/v1/kv/prefetch", "Promote a prompt's cached KV from the lower tiers"),
            ("/v1/kv/lease", "Lend a prompt's cached KV to a peer worker"),
        )
    }


def erasure_operations(key: str | None, fan_out: bool = False) -> dict[tuple[str, str], Operation]:
    """Erasing a session's or the caller's tenant's KV (``worker.erasure``); the router
    asks every worker (``fan_out``) and answers 502 when one failed."""
    errors = {
        "403": "the path names another tenant than the caller's",
        "404": "the path names no session or tenant",
        **({"502": "a worker could not erase; the others did (retry)"} if fan_out else {}),
        **({} if fan_out else {"501": "this worker's engine cannot erase KV"}),
        **_UNAVAILABLE,
    }
    answer = {"application/json": {"type": "object", "required": ["object", "tenant"]}}
    return {
        ("delete", path): Operation(summary, ok=answer, errors=errors, key=key)
        for path, summary in (
            ("/v1/sessions/{session_id}", "Erase a session's KV from every tier"),
            ("/v1/tenants/{tenant_id}/kv", "Erase the caller's tenant's KV from every tier"),
        )
    }


def install(app: FastAPI, operations: dict[tuple[str, str], Operation]) -> None:
    """Serve ``app``'s generated schema with ``operations`` merged in (added where FastAPI
    does not route the path itself)."""
    generated = app.openapi
    cached: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if not cached:
            cached.update(_merged(copy.deepcopy(generated()), operations))
        return cached

    app.openapi = openapi  # type: ignore[method-assign]


def _merged(schema: dict[str, Any], operations: dict[tuple[str, str], Operation]) -> dict:
    refs, defs = _model_schemas(_models(operations.values()))
    components = schema.setdefault("components", {})
    components.setdefault("schemas", {}).update(defs)
    error = refs[ErrorResponse]
    for (method, path), op in operations.items():
        target = schema.setdefault("paths", {}).setdefault(path, {}).setdefault(method, {})
        target.setdefault("summary", op.summary)
        if op.body is not None:
            target["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": _schema(op.body, refs)}},
            }
        responses = target.setdefault("responses", {})
        if op.ok:
            content = {t: {"schema": _schema(m, refs)} for t, m in op.ok.items()}
            for status in op.ok_statuses:
                responses[status] = {"description": "Successful Response", "content": content}
        errors = {**op.errors, **(_AUTH_ERRORS if op.key else {})}
        for status, when in errors.items():
            responses[status] = {
                "description": when,
                "content": {"application/json": {"schema": error}},
            }
        if op.key is not None:
            target["security"] = [{op.key: []}]
            schemes = components.setdefault("securitySchemes", {})
            schemes[op.key] = {"type": "http", "scheme": "bearer"}
    return schema


def _schema(model: type[BaseModel] | dict[str, Any], refs: dict) -> dict[str, Any]:
    return refs[model] if isinstance(model, type) else model


def _models(operations: Iterable[Operation]) -> list[type[BaseModel]]:
    found = [ErrorResponse]
    for op in operations:
        for m in (op.body, *op.ok.values()):
            if isinstance(m, type) and m not in found:
                found.append(m)
    return found


def _model_schemas(models: list[type[BaseModel]]) -> tuple[dict, dict]:
    """Each model's ``$ref`` and every definition they need (request models as validated,
    the rest as serialised)."""
    keys = [(m, "validation" if m in _REQUESTS else "serialization") for m in models]
    refs, top = models_json_schema(keys, ref_template=_REF)  # type: ignore[arg-type]
    return {m: refs[(m, mode)] for m, mode in keys}, top.get("$defs", {})


_REQUESTS = (ChatCompletionRequest, CompletionRequest, KVPrefetchRequest, ResponsesRequest)
