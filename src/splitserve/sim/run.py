"""One simulated run: a workload through a deployment, summarized as ``splitserve bench`` does."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from splitserve.sim.cluster import Cluster, chain_plan
from splitserve.sim.deployment import Deployment, SimConfig
from splitserve.sim.feed import fed_sessions
from splitserve.workload.metrics import SLO, summarize
from splitserve.workload.runs import RunResult
from splitserve.workload.sessions import Workload, within


@dataclass(slots=True)
class SimResult:
    run: RunResult  # what ``splitserve bench`` reports for a measured run
    cluster: Cluster

    @property
    def summary(self):
        return self.run.summary

    @property
    def records(self):
        return self.run.records


def simulate(
    config: SimConfig,
    deployment: Deployment,
    workload: Workload,
    rate: float,
    duration_s: float,
    slo: SLO | None = None,
    gen_workers: int = 0,
) -> SimResult:
    """The sessions arriving in ``duration_s`` at ``rate``, each played to its end (an open
    loop, as ``splitserve bench --rate R --duration S`` with an unbounded drain).
    ``gen_workers`` 1: the sessions' random draws are made ahead in a second process
    (``sim/feed.py``; the same sessions, worth it from some thousands of sessions)."""
    if not rate > 0 or not duration_s > 0:
        raise ValueError(f"the rate and duration must be > 0, got {rate} and {duration_s}")
    if gen_workers not in (0, 1):
        raise ValueError(f"gen_workers must be 0 or 1, got {gen_workers}")
    with contextlib.ExitStack() as stack:
        fed = None
        if gen_workers:
            sessions = fed = stack.enter_context(fed_sessions(workload, rate, chain_plan(config)))
        else:
            sessions = workload.sessions(rate)
        cluster = Cluster(config, deployment)  # built while the child starts
        records = cluster.run(within(sessions, duration_s), fed=fed)
    duration = max((r.end_s for r in records), default=0.0)  # from the first arrival at 0
    info = {
        "workload": workload.describe(),
        "load": f"{rate:g} sessions/s, {duration_s:g} s",
        "deployment": deployment.describe(),
        "hardware": f"{config.hardware.name}, {config.model.name} {config.dtype}",
        "simulated": True,
    }
    summary = summarize(records, duration, slo or SLO(), _counters(cluster), info)
    return SimResult(RunResult(summary, records), cluster)


def _counters(cluster: Cluster) -> dict[str, float]:
    """The simulated servers' counters, shaped like the ones bench reads from /metrics."""
    workers = cluster.workers
    span = cluster.now or 1.0
    queries = sum(w.engine.block_manager.prefix_queries for w in workers)
    hits = sum(w.engine.block_manager.prefix_hits for w in workers)
    s = cluster.stats
    return {
        "remote prefills": s.remote_prefills,
        "local prefills": s.local_prefills,
        "KV blocks transferred": s.kv_blocks_moved,
        "KV pull fallbacks": s.transfer_fallbacks,
        "preemptions": sum(w.engine.scheduler.num_preemptions for w in workers),
        "prefix cache hit rate (%)": 100.0 * hits / queries if queries else 0.0,
        "mean worker busy (%)": 100.0 * sum(w.busy_s for w in workers) / (span * len(workers)),
        "engine steps (events)": sum(w.steps for w in workers),
        **_tier_counters(cluster),
        **_peer_counters(cluster),
        **_core_counters(cluster),
    }


def _core_counters(cluster: Cluster) -> dict[str, float]:
    if cluster.cores is None:
        return {}
    return {
        "engine busy (s)": sum(w.busy_s for w in cluster.workers),
        "engine compute (s)": sum(w.engine_s for w in cluster.workers),
        "serving CPU on the shared cores (s)": cluster.cores.serving_s,
    }


def _peer_counters(cluster: Cluster) -> dict[str, float]:
    if not cluster.config.kv_peer_fetch:
        return {}
    s = cluster.stats
    return {
        "KV peer fetches": s.peer_fetches,
        "KV blocks pulled from peers": s.peer_blocks_moved,
        "KV peer fetches with nothing new": s.peer_nothing,
        "KV peer fetch fallbacks": s.peer_fallbacks,
    }


def _tier_counters(cluster: Cluster) -> dict[str, float]:
    tierings = [w.engine.tiering for w in cluster.workers if w.engine.tiering is not None]
    if not tierings:
        return {}
    s = cluster.stats
    return {
        "KV tier loads": s.tier_loads,
        "KV blocks loaded from host RAM": s.tier_blocks_host,
        "KV blocks loaded from disk": s.tier_blocks_disk,
        "KV blocks saved below the pool": sum(t.stats.blocks_saved for t in tierings),
    }
