"""How fast the simulator runs: requests per wall-clock second at datacenter scale.

Agentic sessions (the bench workload) through a disaggregated deployment of GPUS H100s
(llama3-70b at TP8: a quarter prefill, the rest decode), at a session rate that keeps the
cluster busy. Prints the configuration, the wall time, requests per second, and the
projection to one million requests (the goal: 1M requests over 1,000 GPUs in <= 120 s).

    .venv/bin/python benchmarks/sim_scale.py --sessions 20000 --gpus 1000
    .venv/bin/python benchmarks/sim_scale.py --compiled build/sim-compiled   # mypyc build

``--compiled DIR`` runs the modules ``benchmarks/sim_compile.py`` compiled into DIR (it
refuses a build older than the sources). The sessions' random draws are made ahead in a
second process (``sim/feed.py``: the same sessions); ``--gen-workers 0`` makes them in the
run, as before. The load average is printed before and after: the
machine is shared, so CPU seconds are the steadier figure.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import resource
import time

from sim_compile import use_compiled


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=20000)
    ap.add_argument("--gpus", type=int, default=1000)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rate-per-gpu", type=float, default=0.1, help="sessions/s per GPU")
    ap.add_argument("--host-kv-gb", type=float, default=0.0, help="host-RAM KV tier per worker")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--sort", default="tottime")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--compiled", metavar="DIR", help="import splitserve from a mypyc build")
    ap.add_argument(
        "--gen-workers",
        type=int,
        default=1,
        choices=[0, 1],
        help="processes making the sessions' random draws ahead (0: the run makes them)",
    )
    args = ap.parse_args()
    if args.compiled:
        use_compiled(args.compiled)
    run(args)


def run(args: argparse.Namespace) -> None:
    from splitserve.sim import cluster as cluster_module
    from splitserve.sim.cluster import Cluster, chain_plan
    from splitserve.sim.deployment import Deployment, SimConfig
    from splitserve.sim.feed import fed_sessions
    from splitserve.sim.hardware import get_hardware
    from splitserve.sim.models import get_model
    from splitserve.workload.sessions import AgenticConfig

    compiled = not cluster_module.__file__.endswith(".py")
    workers = args.gpus // args.tp
    dep = Deployment(prefill=workers // 4, decode=workers - workers // 4, tp=args.tp)
    cfg = SimConfig(
        get_model(args.model),
        get_hardware("h100"),
        block_size=args.block_size,
        host_kv_gb=args.host_kv_gb,
    )
    rate = args.rate_per_gpu * args.gpus
    tiers = f", {args.host_kv_gb:g} GB host KV tier per worker" if args.host_kv_gb else ""
    print(f"{dep.describe()}, {args.model} on h100, block {args.block_size}{tiers};")
    print(f"agentic at {rate:g} sessions/s, {args.sessions} sessions")
    print(f"modules: {'compiled (mypyc)' if compiled else 'interpreted'}; {_load()}")
    print(
        f"session draws: {'made ahead in a second process' if args.gen_workers else 'in the run'}"
    )
    workload = AgenticConfig()
    child_cpu = _children_cpu()
    with contextlib.ExitStack() as stack:
        # The child starts while the cluster is built.
        fed = None
        if args.gen_workers:
            sessions = fed = stack.enter_context(fed_sessions(workload, rate, chain_plan(cfg)))
        else:
            sessions = workload.sessions(rate)
        t0 = time.perf_counter()
        cluster = Cluster(cfg, dep)
        built = time.perf_counter() - t0
        prof = cProfile.Profile() if args.profile else None
        if prof:
            prof.enable()
        t1, c1 = time.perf_counter(), time.process_time()
        records = cluster.run(sessions, limit=args.sessions, fed=fed)
        wall, cpu = time.perf_counter() - t1, time.process_time() - c1
    child_cpu = _children_cpu() - child_cpu
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats(args.sort).print_stats(args.top)
    n = len(records)
    ok = sum(r.ok for r in records)
    blocks = sum(w.engine.block_manager.prefix_queries for w in cluster.workers) / max(n, 1)
    events = sum(w.steps for w in cluster.workers)
    print(f"build {built:.1f} s; run {wall:.1f} s ({cpu:.1f} s of CPU) for {n} requests ({ok} ok),")
    if args.gen_workers:
        print(f"and {child_cpu:.1f} s of CPU in the draws process (its whole life)")
    print(f"{cluster.now:.0f} s simulated, {events} engine events")
    per_request = 1e6 * wall / n
    print(f"{n / wall:.0f} requests/s ({n / cpu:.0f} per CPU second), {per_request:.0f} us each;")
    print(f"{blocks:.0f} prompt blocks looked up per request")
    print(
        f"projected 1M requests: {built + wall * 1e6 / n:.0f} s (goal <= 120 s), "
        f"{built + cpu * 1e6 / n:.0f} s of CPU; {_load()}"
    )


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
