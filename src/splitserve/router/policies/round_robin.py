"""Each worker in turn: the baseline that ignores sessions and caches."""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.router.policies.base import RequestInfo, RoutingPolicy
from splitserve.router.worker import Worker


class RoundRobinPolicy(RoutingPolicy):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def select_worker(self, workers: Sequence[Worker], info: RequestInfo) -> Worker | None:
        if not workers:
            return None
        ordered = sorted(workers, key=lambda w: w.url)  # stable order whatever the caller's
        worker = ordered[self._next % len(ordered)]
        self._next += 1
        return worker
