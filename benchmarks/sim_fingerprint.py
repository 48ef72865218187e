"""A fingerprint of what the simulator computes: run it before and after a change that must
not change results (a speed-up); the hashes must be equal.

Seven fixed runs cover the paths a speed-up can break: disaggregated at 16- and 64-token
blocks, a small pool with preemptions and KV-pull fallbacks, collocated round-robin,
least-loaded, ``exact=True`` and the prefix policy on decode. Each hash covers every
record (TTFT, E2E, inter-token gaps, cached tokens, errors), every worker's counters and
the cluster's stats.

    .venv/bin/python benchmarks/sim_fingerprint.py
    .venv/bin/python benchmarks/sim_fingerprint.py --gen-workers 1   # draws made ahead
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import time

from splitserve.sim.cluster import Cluster, chain_plan
from splitserve.sim.deployment import Deployment, SimConfig
from splitserve.sim.feed import FedSessions, fed_sessions
from splitserve.sim.hardware import get_hardware
from splitserve.sim.models import get_model
from splitserve.workload.sessions import AgenticConfig, RandomConfig


def fingerprint(
    config: SimConfig, deployment: Deployment, sessions, limit: int, fed: FedSessions | None = None
) -> tuple[str, int]:
    cluster = Cluster(config, deployment)
    records = cluster.run(sessions, limit=limit, fed=fed)
    h = hashlib.sha256()
    for r in records:
        timing = (r.start_s, r.ttft_s, r.itl_s, r.e2e_s)
        h.update(repr((r.session_id, r.turn, r.ok, r.prompt_tokens, r.output_tokens)).encode())
        h.update(repr((r.cached_tokens, r.error) + timing).encode())
    for w in cluster.workers:
        bm, sched = w.engine.block_manager, w.engine.scheduler
        h.update(repr((w.name, w.steps, w.busy_s, bm.prefix_queries, bm.prefix_hits)).encode())
        h.update(repr((sched.num_preemptions, bm.num_free_blocks, bm.num_cached_blocks)).encode())
    h.update(f"({stats_repr(cluster.stats)}, {cluster.now!r})".encode())
    return h.hexdigest()[:16], len(records)


def stats_repr(stats) -> str:
    """The stats' dataclass repr, less the KV-tier and peer-fetch counters while they are 0,
    so that the hashes of runs without them stay those taken before they existed."""
    fields = dataclasses.asdict(stats).items()
    shown = (f"{k}={v!r}" for k, v in fields if v or not k.startswith(("tier_", "peer_")))
    return f"{type(stats).__name__}({', '.join(shown)})"


def cases() -> list[tuple]:
    model, hw = get_model("llama3-70b"), get_hardware("h100")

    def config(**options) -> SimConfig:
        return SimConfig(model, hw, **options)

    busy, light, single = (AgenticConfig(), 100.0), (AgenticConfig(), 20.0), (RandomConfig(), 10.0)

    large = Deployment(31, 94, tp=8)
    least = dict(policy="least-loaded", prefill_policy="least-loaded")
    return [
        ("31P:94D, block 16", config(block_size=16), large, busy, 1500),
        ("31P:94D, block 64", config(block_size=64), large, busy, 1500),
        (
            "2P:3D, 2 GiB KV",
            config(kv_cache_gb=2.0, record_itl=True),
            Deployment(2, 3, tp=8),
            light,
            300,
        ),
        (
            "6 collocated, round-robin",
            config(policy="round-robin", kv_cache_gb=4.0),
            Deployment(collocated=6, tp=8),
            light,
            300,
        ),
        (
            "2P:4D, least-loaded",
            config(kv_cache_gb=4.0, record_itl=True, **least),
            Deployment(2, 4, tp=8),
            light,
            300,
        ),
        ("1P:2D, exact", config(exact=True, kv_cache_gb=1.0), Deployment(1, 2, tp=8), single, 150),
        (
            "2P:5D, prefix on decode",
            config(policy="prefix", kv_cache_gb=4.0),
            Deployment(2, 5, tp=8),
            light,
            300,
        ),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--gen-workers", type=int, default=0, choices=[0, 1], help="draws made ahead (sim/feed.py)"
    )
    args = ap.parse_args()
    for name, config, deployment, (workload, rate), limit in cases():
        t0 = time.perf_counter()
        with contextlib.ExitStack() as stack:
            fed = None
            if args.gen_workers:
                sessions = fed = stack.enter_context(
                    fed_sessions(workload, rate, chain_plan(config))
                )
            else:
                sessions = workload.sessions(rate)
            digest, n = fingerprint(config, deployment, sessions, limit, fed)
        print(f"{name:26s} {digest}  ({n} requests, {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
