"""Always the worker with the fewest requests (running + waiting, or in flight from here)."""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.router.policies.base import RequestInfo, RoutingPolicy, least_loaded
from splitserve.router.worker import Worker


class LeastLoadedPolicy(RoutingPolicy):
    name = "least-loaded"

    def select_worker(self, workers: Sequence[Worker], info: RequestInfo) -> Worker | None:
        return least_loaded(workers)
