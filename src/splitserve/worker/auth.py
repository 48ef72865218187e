"""Who sent a request to this worker: a client with an API key, or the router (or a peer
worker) vouching for a tenant with the cluster secret (``common/tenants.py``).

After the check, ``request.state.tenant`` is the tenant id, ``request.state.principal``
whose KV the request makes (the tenant, or one of its keys), and ``request.state.signed``
says whether a cluster member vouched for the request: only then may its body carry the
fields that make this worker contact other hosts (``kv_peer``, ``kv_transfer_params``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import Request

from splitserve.common.kv_salts import KVSalts
from splitserve.common.tenants import (
    TENANT_HEADER,
    InvalidSignature,
    Tenants,
    sign,
    tenant_of_principal,
    verify,
)
from splitserve.worker.errors import APIError


class WorkerAuth:
    """The FastAPI dependency guarding the API routes, and the salt of a request's KV."""

    def __init__(self, tenants: Tenants, secret: bytes = b"", salts: KVSalts | None = None):
        self.tenants = tenants
        self.secret = secret
        self.salts = salts or KVSalts(tenants, secret)

    @classmethod
    def for_model(cls, tenants: Tenants, secret: bytes, tokenizer: Any) -> WorkerAuth:
        """With the tenants' public prefixes tokenized by the served model's tokenizer."""
        salts = KVSalts(
            tenants,
            secret,
            lambda text: list(tokenizer.encode(text)),
            lambda messages: list(tokenizer.apply_chat_template(messages)),
        )
        return cls(tenants, secret, salts)

    async def __call__(self, request: Request) -> None:
        vouched = request.headers.get(TENANT_HEADER)
        if vouched is not None:
            principal = await self._verified(request, vouched)
            request.state.principal = principal
            request.state.tenant = tenant_of_principal(principal)
            request.state.signed = True
            return
        key = self.tenants.identify(request.headers.get("authorization", ""))
        if key is None:
            raise APIError(
                401,
                "Incorrect or missing API key; send 'Authorization: Bearer KEY'",
                code="invalid_api_key",
            )
        request.state.principal = key.principal
        request.state.tenant = key.tenant.id
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

    def salt(
        self, request: Request, cache_salt: str | None, prompt_ids: Sequence[int] | None
    ) -> str:
        """The block-hash salt of an authenticated request's KV for this prompt."""
        return self.salts.salt(request.state.principal, cache_salt, prompt_ids)

    def signed_headers(self, tenant: str, method: str, path: str, body: bytes) -> dict[str, str]:
        """Headers for this worker's own call to a peer on ``tenant``'s behalf (a
        principal)."""
        return {
            "content-type": "application/json",
            TENANT_HEADER: sign(self.secret, method, path, tenant, body),
        }
