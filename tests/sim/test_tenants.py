"""Simulated sessions hash their KV from their tenant's root: one tenant's cached blocks
never serve another's prompt, while sessions of one tenant share them."""

from __future__ import annotations

from splitserve.common.kv_hash import root_hash
from splitserve.sim.cluster import Cluster
from splitserve.sim.deployment import Deployment
from splitserve.workload.sessions import Segment, SessionSpec, TurnSpec
from tests.sim.helpers import config

SYSTEM = tuple(range(1000, 1256))  # 16 full blocks of 16 tokens


def session(sid: str, arrival_s: float, tenant: str) -> SessionSpec:
    turn = TurnSpec(0.0, (Segment("system", SYSTEM),), 4, (7, 7, 7, 7))
    return SessionSpec(sid, arrival_s, 0, (turn,), tenant=tenant)


def cached(tenants: list[str]) -> list[int]:
    """Cached prompt tokens of one session per tenant, one after another on one worker."""
    sessions = [session(f"s{i}", 10.0 * i, t) for i, t in enumerate(tenants)]
    cluster = Cluster(config(), Deployment(collocated=1))
    records = cluster.run(iter(sessions))
    assert all(r.ok for r in records)
    return [r.cached_tokens for r in sorted(records, key=lambda r: r.start_s)]


def test_a_tenant_hits_its_own_blocks_only():
    assert cached(["a", "a"]) == [0, 240]  # all but the last block, which is recomputed
    assert cached(["a", "b"]) == [0, 0]
    assert cached(["", "a", ""]) == [0, 0, 240]


def test_the_default_tenant_hashes_from_the_unsalted_root():
    cluster = Cluster(config(), Deployment(collocated=1))
    assert cluster.root == root_hash(cluster.config.model.name) == cluster._root("")
    assert cluster._root("a") == root_hash(cluster.config.model.name, "a") != cluster.root
