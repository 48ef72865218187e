"""One request on its way through the router, and the failure that lets it go elsewhere."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from splitserve.common.tenants import DEFAULT_TENANT
from splitserve.router.migration import StreamRelay
from splitserve.router.placement import Uncached
from splitserve.router.policies import RequestInfo
from splitserve.router.responses_relay import ResponsesRelay
from splitserve.router.timing import Timeline
from splitserve.router.worker import Worker


class WorkerFailed(Exception):
    """The worker failed before sending its first byte: the request may go elsewhere.
    ``dropped``: an open connection was closed or reset before any answer (``upstream``)."""

    def __init__(self, message: str, dropped: bool = False) -> None:
        super().__init__(message)
        self.dropped = dropped


@dataclass(slots=True)
class Forwarding:
    """One request on its way: what the policies know of it, and what its legs need."""

    info: RequestInfo
    home: str | None  # the session's home worker
    uncached: Uncached = Uncached(0.0, 0.0)
    prefill: Worker | None = None
    kv_params: dict[str, Any] | None = None
    # Streamed requests: what was delivered, so the stream can move to another worker.
    relay: StreamRelay | ResponsesRelay | None = None
    headers: dict[str, str] | None = None
    excluded: list[str] | None = None  # decode workers tried so far
    timeline: Timeline | None = None
    predicted: tuple[str, int] | None = None  # (decode worker, tokens its KV events showed)
    tenant: str = DEFAULT_TENANT  # the principal its legs are signed for (a tenant or key)
