"""The router's side of ``/v1/responses``: every turn of a response chain goes to the same
session, and stored responses are fetched and deleted wherever they are.

Session key: the chain's (``session.chain_key``), read out of ``previous_response_id`` or,
for a first turn, a new chain named to the worker; either way no table is kept, so any router
replica, restarted or not, maps every turn of a chain to the worker that holds its
conversation and KV.

``POST /v1/responses`` is forwarded like a chat request (placement, retries before the
first byte, the stream relayed as it comes, resumed on another worker when its worker dies
mid-stream: ``responses_relay``). A first turn on builtin workers may take the remote
prefill leg as chat does (the prefill worker runs the same request, one token, not stored:
``disagg.responses_prefill_body``); a turn that continues a chain never does, since its
stored conversation is on its decode worker alone, which holds its KV too.

``GET`` and ``DELETE`` ``/v1/responses/{id}`` ask every worker: one holds the response;
``DELETE`` also erases the chain's KV wherever a worker has some. Over vLLM workers ``DELETE``
is a 400 that says why (``VLLM_CANNOT_DELETE``): vLLM can neither delete a stored response nor
erase one chain's KV from its prefix cache, and the router will not claim it did.

A migrated response is stored by the worker that finished it. A later turn that lands on a
worker without it (its first worker is back) is answered 400 ``previous_response_not_found``
there; the proxy then asks the other workers and remembers where the chain went
(``response_homes``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from splitserve.common.responses_api import RESPONSES_PATH
from splitserve.common.tenants import Tenants
from splitserve.router.errors import RouterError
from splitserve.router.front import caller_tenant
from splitserve.router.membership import Membership
from splitserve.router.proxy import Proxy
from splitserve.router.upstream import UpstreamError

FAN_OUT_TIMEOUT_S = 60.0
VLLM_CANNOT_DELETE = (
    "DELETE /v1/responses/{id} is not supported with vLLM workers: vLLM has no way to delete a "
    "stored response, and its prefix cache cannot erase one chain's KV (blocks leave it only by "
    "eviction). A stored response stays on its worker until that worker restarts; send "
    "store: false to keep none."
)


def responses_routes(
    proxy: Callable[[], Proxy], membership: Membership, tenants: Tenants
) -> APIRouter:
    """``GET`` and ``DELETE /v1/responses/{id}``, asked of every member worker."""
    router = APIRouter()

    def tenant_of(request: Request) -> str:
        return caller_tenant(tenants, request.headers.get("authorization", ""))

    @router.get(RESPONSES_PATH + "/{rid}")
    async def retrieve(rid: str, request: Request) -> JSONResponse:
        return await _ask_all(proxy(), membership, "GET", rid, request, tenant_of(request))

    @router.delete(RESPONSES_PATH + "/{rid}")
    async def delete(rid: str, request: Request) -> JSONResponse:
        tenant = tenant_of(request)
        if proxy().config.worker_engine == "vllm":
            raise RouterError(400, VLLM_CANNOT_DELETE, "unsupported_on_vllm", "response_id")
        return await _ask_all(proxy(), membership, "DELETE", rid, request, tenant)

    return router


async def _ask_all(
    proxy: Proxy, membership: Membership, method: str, rid: str, request: Request, tenant: str
) -> JSONResponse:
    """The answer of the worker holding the response; 404 when every worker said it has
    none, 502 when none has it and some could not answer."""
    path = f"{RESPONSES_PATH}/{rid}"
    headers = proxy._forward_headers({k.lower(): v for k, v in request.headers.items()})
    headers = proxy.vouch.headers(headers, tenant, method, path, None)
    urls = [w.url for w in membership.all()]
    calls = (_one(proxy, url, method, quote(path), headers) for url in urls)
    answers = await asyncio.gather(*calls)
    for status, body in answers:
        if status == 200:
            return JSONResponse(body)
    refusals = [(s, b) for s, b in answers if 400 <= s < 500]
    if refusals and len(refusals) == len(answers):
        return JSONResponse(refusals[0][1], status_code=refusals[0][0])
    if not answers:
        raise RouterError(404, f"Response with id '{rid}' not found.", param="response_id")
    raise RouterError(502, "no worker holds the response and some could not be asked; retry")


async def _one(
    proxy: Proxy, url: str, method: str, path: str, headers: dict[str, str]
) -> tuple[int, Any]:
    try:
        async with asyncio.timeout(FAN_OUT_TIMEOUT_S):
            response = await proxy.client.request(method, url, path, headers)
            try:
                status, raw = response.status, await response.read()
            finally:
                response.release()
    except (UpstreamError, OSError, TimeoutError):
        return 502, None
    try:
        return status, json.loads(raw)
    except ValueError:
        return 502, None
