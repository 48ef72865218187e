"""Erasing a session's or a tenant's KV from this worker: ``DELETE /v1/sessions/{id}`` and
``DELETE /v1/tenants/{id}/kv``.

The owner record (``worker.kv_owners``) names the blocks; the leases that hold one of them
end here; the engine erases them from its pool, pins and tiers (``engine.erasure``); then
the record forgets them. Blocks another live session of the tenant (or a running request)
also made are kept and counted in ``kept_shared``; blocks a running request still uses stay
in the device pool, are erased below it, and are counted in ``in_use``.

An unknown session or a tenant with nothing here erases nothing and answers 200 with zeros:
erasure is idempotent, and the router asks every worker, most of which never saw the
session. A tenant may erase only its own KV (the default tenant's id is ``default``).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request

from splitserve.common.protocol import ChatCompletionRequest, CompletionRequest
from splitserve.common.tenants import DEFAULT_TENANT
from splitserve.transfer.errors import LeaseNotFound
from splitserve.worker.async_engine import AsyncEngine, EngineError
from splitserve.worker.errors import APIError
from splitserve.worker.kv_api import KVSides, session_of
from splitserve.worker.kv_owners import Claim, KVOwners, OwnedStream

log = logging.getLogger(__name__)


def tenant_of(request: Request) -> str:
    """The tenant the request authenticated as (``worker.auth``)."""
    return getattr(request.state, "tenant", DEFAULT_TENANT)


def own_stream(
    request: Request,
    req: ChatCompletionRequest | CompletionRequest,
    request_id: str,
    prompt: list[int],
    stream: Any,
) -> Any:
    """``stream`` recorded in the owner record: the prompt's blocks now, the rest at its end."""
    owners: KVOwners | None = getattr(request.app.state, "kv_owners", None)
    if owners is None:
        return stream
    tenant, salt = tenant_of(request), getattr(request.state, "kv_salt", "")
    key = owners.begin(tenant, session_of(req, request), request_id, salt, prompt)
    return OwnedStream(stream, owners, key, salt, prompt)


def erasure_routes(async_engine: AsyncEngine, kv: KVSides, owners: KVOwners | None) -> APIRouter:
    router = APIRouter()

    @router.delete("/v1/sessions/{session_id:path}")
    async def erase_session(session_id: str, request: Request) -> dict[str, Any]:
        tenant = tenant_of(request)
        record = _record(owners)
        answer = await _erase(record.claim_session(tenant, session_id), async_engine, kv)
        record.forget_session(tenant, session_id)
        return {"object": "kv.erasure", "session": session_id, "tenant": tenant} | (answer)

    @router.delete("/v1/tenants/{tenant_id}/kv")
    async def erase_tenant(tenant_id: str, request: Request) -> dict[str, Any]:
        tenant = tenant_of(request)
        if tenant_id != tenant:
            raise APIError(
                403, "a tenant may erase only its own KV", param="tenant", code="tenant_mismatch"
            )
        record = _record(owners)
        answer = await _erase(record.claim_tenant(tenant), async_engine, kv)
        record.forget_tenant(tenant)
        # The tenant's stored responses hold its conversations (on disk too, with a disk tier).
        answer["responses"] = request.app.state.responses.forget_tenant(tenant)
        return {"object": "kv.erasure", "session": None, "tenant": tenant_id} | answer

    return router


def _record(owners: KVOwners | None) -> KVOwners:
    if owners is None:
        raise APIError(501, "this engine cannot erase KV blocks", code="erasure_unsupported")
    return owners


async def _erase(claim: Claim, async_engine: AsyncEngine, kv: KVSides) -> dict[str, Any]:
    # Leases end first: their blocks go back to the pool by engine calls queued before ours.
    leases = _end_leases(kv, claim.erase)
    try:
        erased = await async_engine.call(lambda e: e.erase_blocks(claim.erase))
    except EngineError as e:
        raise APIError(503, str(e), code="engine_unavailable") from e
    except TimeoutError as e:
        raise APIError(503, f"KV erasure did not finish: {e}", code="erasure_timeout") from e
    removed = erased.as_dict()
    in_use = removed.pop("in_use")
    removed["leases"] = leases
    return {
        "blocks": len(claim.erase),
        "removed": removed,
        "kept_shared": len(claim.shared),
        "in_use": in_use,
    }


def _end_leases(kv: KVSides, hashes: set[bytes]) -> int:
    if kv.server is None or not hashes:
        return 0
    ended = 0
    for request_id in kv.server.leases.holding(hashes):
        try:
            kv.server.leases.release(request_id)
            ended += 1
        except LeaseNotFound:
            pass  # ended meanwhile
    return ended
