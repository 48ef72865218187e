"""Routing policies, chosen by name: ``make_policy("session", load_factor=1.5)``."""

from __future__ import annotations

from typing import Any

from splitserve.router.policies.base import RequestInfo, RoutingPolicy
from splitserve.router.policies.kv_events import KVEventsPolicy
from splitserve.router.policies.least_loaded import LeastLoadedPolicy
from splitserve.router.policies.prefix import PrefixPolicy
from splitserve.router.policies.round_robin import RoundRobinPolicy
from splitserve.router.policies.session import SessionPolicy

POLICIES: dict[str, type[RoutingPolicy]] = {
    p.name: p
    for p in (SessionPolicy, PrefixPolicy, KVEventsPolicy, LeastLoadedPolicy, RoundRobinPolicy)
}

__all__ = ["POLICIES", "RequestInfo", "RoutingPolicy", "make_policy"]


def make_policy(name: str, **options: Any) -> RoutingPolicy:
    """A new policy instance by registry name; unknown names are a clear error."""
    try:
        cls = POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown routing policy {name!r}; choose from {known}") from None
    return cls(**options)
