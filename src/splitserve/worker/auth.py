"""Who sent a request to this worker: a client with an API key, or the router (or a peer
worker) vouching for a tenant with the cluster secret (``common/tenants.py``).

After the check, ``request.state.tenant`` is the tenant id and ``request.state.signed``
says whether a cluster member vouched for the request: only then may its body carry the
fields that make this worker contact other hosts (``kv_peer``, ``kv_transfer_params``).
"""

from __future__ import annotations

from fastapi import Request

from splitserve.common.tenants import (
    TENANT_HEADER,
    InvalidSignature,
    Tenants,
    kv_salt,
    sign,
    verify,
)
from splitserve.worker.errors import APIError


class WorkerAuth:
    """The FastAPI dependency guarding the API routes, and the salt of a request's KV."""

    def __init__(self, tenants: Tenants, secret: bytes = b"") -> None:
        self.tenants = tenants
        self.secret = secret

    async def __call__(self, request: Request) -> None:
        vouched = request.headers.get(TENANT_HEADER)
        if vouched is not None:
            request.state.tenant = await self._verified(request, vouched)
            request.state.signed = True
            return
        tenant = self.tenants.authenticate(request.headers.get("authorization", ""))
        if tenant is None:
            raise APIError(
                401,
                "Incorrect or missing API key; send 'Authorization: Bearer KEY'",
                code="invalid_api_key",
            )
        request.state.tenant = tenant.id
        request.state.signed = False

    async def _verified(self, request: Request, value: str) -> str:
        if not self.secret:
            raise APIError(
                401,
                "a signed request reached a worker without the cluster secret",
                code="invalid_signature",
            )
        body = await request.body()
        try:
            return verify(self.secret, value, request.method, request.url.path, body)
        except InvalidSignature as e:
            raise APIError(401, str(e), code="invalid_signature") from e

    def salt(self, request: Request, cache_salt: str | None) -> str:
        """The block-hash salt of an authenticated request's KV."""
        return kv_salt(self.secret, request.state.tenant, cache_salt)

    def signed_headers(self, tenant: str, method: str, path: str, body: bytes) -> dict[str, str]:
        """Headers for this worker's own call to a peer on ``tenant``'s behalf."""
        return {
            "content-type": "application/json",
            TENANT_HEADER: sign(self.secret, method, path, tenant, body),
        }
