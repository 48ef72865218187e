"""The router's ``/openapi.json``: the OpenAI endpoints it fronts (served as plain ASGI, so
FastAPI does not list them) and its membership endpoints' bodies."""

from __future__ import annotations

from fastapi import FastAPI

from splitserve.common import openapi
from splitserve.router.config import RouterConfig
from splitserve.router.worker import ROLES

_WORKER_BODY = {
    "type": "object",
    "required": ["url"],
    "properties": {
        "url": {"type": "string", "description": "the worker's base URL"},
        "role": {"type": "string", "enum": list(ROLES), "default": "both"},
    },
}
_WORKER = {"type": "object", "required": ["url", "role", "healthy"]}
_ADMIN_ERRORS = {"403": "membership endpoints are disabled (the router has no admin key)"}


def install(app: FastAPI, config: RouterConfig) -> None:
    key = "bearer" if config.api_key or config.api_keys_file else None
    admin = "admin" if config.admin_key else None
    errors = {**_ADMIN_ERRORS, "401": "the Authorization header is not the admin key"}
    ops = {**openapi.probe_operations(), **openapi.openai_operations(key)}
    ops |= openapi.erasure_operations(key, fan_out=True)
    ops[("post", "/workers")] = openapi.Operation(
        "Add a worker (201) or find it already there (200)",
        _WORKER_BODY,
        ok={"application/json": _WORKER},
        ok_statuses=("200", "201"),
        errors={"400": "not a worker: no URL, an unknown role", **errors},
        key=admin,
    )
    ops[("get", "/workers")] = openapi.Operation(
        "The workers and their state", errors=errors, key=admin
    )
    ops[("delete", "/workers/{url}")] = openapi.Operation(
        "Remove a worker", errors={"404": "no such worker", **errors}, key=admin
    )
    openapi.install(app, ops)
