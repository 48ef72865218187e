"""Prefill placement: the least-loaded worker, ties broken toward the prefix's ring owner.

Prefill is compute-bound, so load comes first; but among equally loaded workers the one that
owns the prompt's shared prefix (its system prompt) on a consistent-hash ring has most
likely prefilled it before and still holds those blocks, so shared prompts keep hitting the
same prefill cache.
"""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.router.policies.base import RequestInfo, RoutingPolicy, least_loaded
from splitserve.router.policies.session import SyncedRing
from splitserve.router.ring import DEFAULT_VNODES
from splitserve.router.worker import Worker


class PrefixPolicy(RoutingPolicy):
    """``slack``: workers within this many requests of the least loaded count as tied."""

    name = "prefix"

    def __init__(self, slack: int = 0, vnodes: int = DEFAULT_VNODES) -> None:
        if slack < 0:
            raise ValueError(f"slack must be >= 0, got {slack}")
        self.slack = slack
        self._ring = SyncedRing(vnodes)

    def select_worker(self, workers: Sequence[Worker], info: RequestInfo) -> Worker | None:
        if not workers or info.prefix_key is None:
            return least_loaded(workers)
        ring = self._ring.sync(workers)
        loads = self._ring.loads
        tied = min(loads.values()) + self.slack  # within this of the least loaded: tied
        url = ring.owner(info.prefix_key, lambda u: loads[u] <= tied)
        return self._ring.worker(url) if url is not None else least_loaded(workers)

    def home_worker(self, workers: Sequence[Worker], info: RequestInfo) -> Worker | None:
        if not workers or info.prefix_key is None:
            return None
        url = self._ring.sync(workers).owner(info.prefix_key)
        return self._ring.worker(url)
