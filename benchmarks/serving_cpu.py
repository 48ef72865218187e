"""Host CPU that serving a request costs outside the engines: the simulator's
``serving_cpu_per_request_s`` and ``serving_cpu_per_token_s`` on ``cpu-local``, which
compete with the workers for the cores under ``sim --host-cores``.

A real ``splitserve serve`` (the router and one worker of one thread, as ``bench compare``
starts them) plays the agentic workload of the validation runs twice, closed loop, one
session at a time so nothing queues: once with its output lengths, once with them
``--longer`` times longer. Each run reads the CPU counters ``splitserve bench`` reports (the
worker process, its engine thread's steps, the router, the load generator); serving is all
of it but the engine thread's steps. Two runs, two unknowns: the CPU per request and per
generated token.

    .venv/bin/python benchmarks/serving_cpu.py [--calibration benchmarks/out/cal-s8.json]

``--calibration FILE`` writes both figures into a ``sim calibrate`` file's fit.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import secrets

import numpy as np

from splitserve.bench.client import Endpoint
from splitserve.bench.compare import DEPLOYMENTS, Running, serve_argv
from splitserve.bench.load import Load, run_load
from splitserve.bench.workloads import AgenticConfig, LogNormal
from splitserve.cluster.local import free_port

WORKLOAD = AgenticConfig(
    agent_types=4,
    system_tokens=256,
    task_tokens=32,
    min_tool_calls=3,
    max_tool_calls=5,
    tool_call_tokens=8,
    answer_tokens=16,
    tool_result_tokens=LogNormal(64, 0.5),
    tool_pause_s=LogNormal(0.05, 0.1),
)


def serving_cpu(server: dict[str, float]) -> float:
    """CPU seconds outside the engine threads' steps."""
    engine = server["engine_cpu_seconds"]
    return (
        server["worker_cpu_seconds"]
        - engine
        + server["router_cpu_seconds"]
        + (server["client_cpu_seconds"])
    )


def fit(runs: list[tuple[int, int, float]]) -> tuple[float, float]:
    """(per request, per token) from (requests, tokens, serving CPU seconds) runs."""
    a = np.array([[n, t] for n, t, _ in runs], dtype=float)
    b = np.array([s for _, _, s in runs])
    (per_request, per_token), *_ = np.linalg.lstsq(a, b, rcond=None)
    return float(per_request), float(per_token)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=40.0)
    ap.add_argument("--longer", type=int, default=6, help="output lengths of the second run")
    ap.add_argument("--calibration", default=None, help="write the figures into this file")
    args = ap.parse_args()
    longer = dataclasses.replace(
        WORKLOAD,
        tool_call_tokens=WORKLOAD.tool_call_tokens * args.longer,
        answer_tokens=WORKLOAD.answer_tokens * args.longer,
    )
    port, key = free_port(), secrets.token_hex(16)
    url = f"http://127.0.0.1:{port}"
    argv = serve_argv(DEPLOYMENTS["collocated-session"], 1, 1, port)
    load = Load(concurrency=1, duration_s=args.duration, drain_s=60.0)
    runs = []
    with Running(DEPLOYMENTS["collocated-session"], argv, url, key, 300.0):
        for workload in (WORKLOAD, longer):
            s = asyncio.run(run_load(Endpoint(url, key), workload, load, progress=False)).summary
            cpu = serving_cpu(s.server)
            runs.append((s.completed, s.total_output_tokens, cpu))
            print(
                f"{workload.describe()}: {s.completed} requests, {s.total_output_tokens} "
                f"tokens; CPU s: engine {s.server['engine_cpu_seconds']:.2f}, serving "
                f"{cpu:.2f} (worker {s.server['worker_cpu_seconds']:.2f}, router "
                f"{s.server['router_cpu_seconds']:.2f}, load generator "
                f"{s.server['client_cpu_seconds']:.2f})",
                flush=True,
            )
    per_request, per_token = fit(runs)
    print(f"serving_cpu_per_request_s {per_request:.5f}\nserving_cpu_per_token_s {per_token:.5f}")
    if args.calibration:
        with open(args.calibration) as f:
            data = json.load(f)
        data["fit"]["serving_cpu_per_request_s"] = max(0.0, per_request)
        data["fit"]["serving_cpu_per_token_s"] = max(0.0, per_token)
        with open(args.calibration, "w") as f:
            json.dump(data, f, indent=1)
        print(f"wrote both into {args.calibration}")


if __name__ == "__main__":
    main()
