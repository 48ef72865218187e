"""A request's place in its tenant's in-flight limits at this router (``common.quotas``)."""

from __future__ import annotations

from splitserve.common.quotas import QuotaExceeded, Quotas, Ticket
from splitserve.common.tenants import Tenant
from splitserve.router.errors import RouterError
from splitserve.router.metrics import RouterMetrics


class Admission:
    """One request's place in its tenant's in-flight limits at this router, taken once the
    proxy knows the request's session (``Proxy.completion``), given back when it ends."""

    def __init__(self, quotas: Quotas, tenant: Tenant, metrics: RouterMetrics) -> None:
        self.quotas, self.tenant, self.metrics = quotas, tenant, metrics
        self.ticket: Ticket | None = None

    def admit(self, session: str | None) -> None:
        try:
            self.ticket = self.quotas.admit(self.tenant, session)
        except QuotaExceeded as e:
            self.metrics.quota_rejections.labels(e.limit).inc()
            raise RouterError(
                429,
                f"{e} ({e.limit}); retry after {e.retry_after_s} s",
                code="quota_exceeded",
                headers={"Retry-After": str(e.retry_after_s)},
            ) from e

    def release(self) -> None:
        if self.ticket is not None:
            self.ticket.release()


def capped(tenant: Tenant) -> bool:
    """Whether the router counts the tenant's requests (it enforces only in-flight limits)."""
    limits = tenant.limits
    return limits.requests_in_flight is not None or limits.session_requests_in_flight is not None
