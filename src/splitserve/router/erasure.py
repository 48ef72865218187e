"""KV erasure across the fleet: ``DELETE /v1/sessions/{id}`` and ``DELETE /v1/tenants/{id}/kv``
asked of every member worker at once, whatever its role or health.

A session's KV may sit on any worker: its home, a worker a turn moved to (and the peer copy
pulled there), a prefill worker. Each worker erases what it holds (``worker.erasure``) and
the router answers with every worker's answer, or why it has none::

    {"object": "kv.erasure", "session": ..., "tenant": ..., "complete": true,
     "workers": {url: <the worker's answer> | {"error": {"status": ..., "message": ...}}}}

Status: 200 when every worker answered 2xx. When some worker could not be reached or failed,
the others' erasures still stand and the answer says which failed (``complete: false``):
the status is the workers' own when they all refused alike with a 4xx (a tenant naming
another tenant: 403), else 502; erasure is idempotent, so the client retries. A router with
no workers answers 200 with no workers. The workers' KV events tell the router's KV index of
the device blocks they drop.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from splitserve.common.tenants import Tenants
from splitserve.router.errors import RouterError
from splitserve.router.front import caller_tenant
from splitserve.router.membership import Membership
from splitserve.router.proxy import Proxy
from splitserve.router.response import UpstreamError

ERASE_TIMEOUT_S = 60.0


def erasure_routes(
    proxy: Callable[[], Proxy], membership: Membership, tenants: Tenants
) -> APIRouter:
    """The routes; the caller's key names its tenant, whose KV alone it may erase (the
    workers learn the tenant from the router's signature)."""
    router = APIRouter()

    def tenant_of(request: Request) -> str:
        return caller_tenant(tenants, request.headers.get("authorization", ""))

    @router.delete("/v1/sessions/{session_id:path}")
    async def erase_session(session_id: str, request: Request) -> JSONResponse:
        tenant = tenant_of(request)
        path = f"/v1/sessions/{session_id}"
        return await _fan_out(proxy(), membership, path, request.headers, tenant, session_id)

    @router.delete("/v1/tenants/{tenant_id}/kv")
    async def erase_tenant(tenant_id: str, request: Request) -> JSONResponse:
        tenant = tenant_of(request)
        if tenant_id != tenant:
            raise RouterError(
                403, "a tenant may erase only its own KV", code="tenant_mismatch", param="tenant"
            )
        path = f"/v1/tenants/{tenant_id}/kv"
        return await _fan_out(proxy(), membership, path, request.headers, tenant)

    return router


async def _fan_out(
    proxy: Proxy,
    membership: Membership,
    path: str,
    client_headers: Mapping[str, str],
    tenant: str,
    session: str | None = None,
) -> JSONResponse:
    """``DELETE path`` (decoded) on every worker for ``tenant``."""
    headers = proxy._forward_headers({k.lower(): v for k, v in client_headers.items()})
    headers = proxy.vouch.headers(headers, tenant, "DELETE", path, None)
    path = quote(path)  # what goes on the wire; the workers sign-check the decoded path
    urls = [w.url for w in membership.all()]
    answers = await asyncio.gather(*(_erase(proxy, url, path, headers) for url in urls))
    statuses = [status for status, _ in answers]
    workers = {url: body for url, (_, body) in zip(urls, answers, strict=True)}
    complete = all(200 <= s < 300 for s in statuses)
    body: dict[str, Any] = {"object": "kv.erasure", "session": session, "tenant": tenant}
    body |= {"complete": complete, "workers": workers}
    status = _status(statuses)
    if status != 200:  # an OpenAI error body too, with each worker's answer beside it
        failed = RouterError(status, "not every worker erased; retry (erasure is idempotent)")
        body["error"] = json.loads(failed.response().body)["error"]
    return JSONResponse(body, status_code=status)


def _status(statuses: list[int]) -> int:
    if all(200 <= s < 300 for s in statuses):
        return 200
    if len(set(statuses)) == 1 and 400 <= statuses[0] < 500:
        return statuses[0]
    return 502


async def _erase(
    proxy: Proxy, url: str, path: str, headers: dict[str, str]
) -> tuple[int, dict[str, Any]]:
    """``DELETE path`` on one worker: (its status, its answer or an error); 502 unreachable."""
    try:
        async with asyncio.timeout(ERASE_TIMEOUT_S):
            response = await proxy.client.request("DELETE", url, path, headers)
            try:
                status, raw = response.status, await response.read()
            finally:
                response.release()
    except (UpstreamError, OSError, TimeoutError) as e:
        return 502, {"error": {"status": None, "message": f"worker unreachable: {e}"}}
    try:
        answer = json.loads(raw)
    except ValueError:
        answer = None
    if 200 <= status < 300 and isinstance(answer, dict):
        return status, answer
    message = answer.get("error", {}).get("message") if isinstance(answer, dict) else None
    return status, {"error": {"status": status, "message": message or raw[:200].decode("latin-1")}}
