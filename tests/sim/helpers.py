"""What the simulator tests share: deployments, a small engine config, a run of sessions."""

from __future__ import annotations

from splitserve.sim.cluster import Cluster
from splitserve.sim.deployment import Deployment, SimConfig
from splitserve.sim.hardware import get_hardware
from splitserve.sim.models import get_model

COLLOCATED = Deployment(collocated=2)
DISAGG = Deployment(prefill=1, decode=2)


def config(**kw) -> SimConfig:
    base = dict(max_num_seqs=32, max_num_batched_tokens=512)
    return SimConfig(get_model("llama3-8b"), get_hardware("h100"), **{**base, **kw})


def run(cfg: SimConfig, dep: Deployment, workload, rate: float, n: int):
    cluster = Cluster(cfg, dep)
    return cluster, cluster.run(workload.sessions(rate), limit=n)
