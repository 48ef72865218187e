"""What the router tells a worker about a request's sender: the worker key, and with the
cluster secret, the tenant's signature over the exact request (``common/tenants.py``)."""

from __future__ import annotations

from splitserve.common.tenants import DEFAULT_TENANT, TENANT_HEADER, sign


class Vouch:
    def __init__(self, secret: bytes = b"", worker_api_key: str | None = None) -> None:
        self.secret = secret
        self.base = {"authorization": f"Bearer {worker_api_key}"} if worker_api_key else {}

    def headers(
        self,
        headers: dict[str, str],
        tenant: str,
        method: str,
        path: str,
        body: bytes | None,
    ) -> dict[str, str]:
        """``headers`` for one request to a worker, signed for ``tenant`` when the router
        holds the cluster secret."""
        if not self.secret:
            return headers
        return {**headers, TENANT_HEADER: sign(self.secret, method, path, tenant, body)}

    def probe(self, path: str) -> dict[str, str]:
        """Headers for a health or load probe (a GET on the default tenant's behalf)."""
        return self.headers(self.base, DEFAULT_TENANT, "GET", path, None)
