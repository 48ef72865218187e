"""The worker's side of the tenants' quotas (``common/quotas.py``): a request is counted in
before it reaches the engine and out when its stream closes, with the tokens it used."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from splitserve.common.quotas import QuotaExceeded, Quotas, Ticket
from splitserve.common.tenants import Tenant
from splitserve.worker.auth import WorkerAuth
from splitserve.worker.errors import APIError
from splitserve.worker.metrics import WorkerMetrics


def admit(
    quotas: Quotas,
    auth: WorkerAuth,
    request: Request,
    session: str | None,
    blocks: int,
    metrics: WorkerMetrics,
) -> Ticket:
    """The request's ticket, or a 429 with ``Retry-After`` naming the limit it passes."""
    tenant_id = request.state.tenant
    tenant = auth.tenants.by_id.get(tenant_id) or Tenant(tenant_id)
    try:
        return quotas.admit(tenant, session, blocks)
    except QuotaExceeded as e:
        metrics.quota_rejections.labels(e.limit).inc()
        raise over_limit(e) from e


def over_limit(e: QuotaExceeded) -> APIError:
    return APIError(
        429,
        f"{e} ({e.limit}); retry after {e.retry_after_s} s",
        code="quota_exceeded",
        headers={"Retry-After": str(e.retry_after_s)},
    )


class CountedStream:
    """A request's output stream that returns its ticket when closed (every consumer
    closes its stream), counting the prompt and generated tokens it used: the prompt once,
    the tokens of every choice (``outputs[0].index``)."""

    def __init__(self, inner: Any, ticket: Ticket, prompt_tokens: int) -> None:
        self._inner, self._ticket = inner, ticket
        self._tokens = prompt_tokens
        self._generated: dict[int, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def __aiter__(self) -> AsyncIterator[Any]:
        async for out in self._inner:
            completion = out.outputs[0]
            self._generated[completion.index] = len(completion.token_ids)
            yield out

    def close(self) -> None:
        self._inner.close()
        self._ticket.release(self._tokens + sum(self._generated.values()))
