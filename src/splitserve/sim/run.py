"""One simulated run: a workload through a deployment, summarized as ``splitserve bench`` does."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.bench.metrics import SLO, RequestRecord, Summary, summarize
from splitserve.bench.workloads import Workload
from splitserve.sim.cluster import Cluster
from splitserve.sim.deployment import Deployment, SimConfig


@dataclass(slots=True)
class SimResult:
    records: list[RequestRecord]
    summary: Summary
    cluster: Cluster


def simulate(
    config: SimConfig,
    deployment: Deployment,
    workload: Workload,
    rate: float | None,
    num_sessions: int,
    slo: SLO | None = None,
) -> SimResult:
    cluster = Cluster(config, deployment)
    records = cluster.run(workload.sessions(rate), limit=num_sessions)
    duration = max((r.end_s for r in records), default=0.0) - min(
        (r.start_s for r in records), default=0.0
    )
    info = {
        "workload": workload.describe(),
        "rate": "all at once" if rate is None else f"{rate:g} sessions/s",
        "deployment": deployment.describe(),
        "hardware": f"{config.hardware.name}, {config.model.name} {config.dtype}",
        "simulated": True,
    }
    return SimResult(
        records, summarize(records, duration, slo or SLO(), _counters(cluster), info), cluster
    )


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
    }


def goodput_per_gpu(result: SimResult, deployment: Deployment) -> float:
    return result.summary.request_goodput / deployment.gpus
