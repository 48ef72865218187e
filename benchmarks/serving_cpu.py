"""Host CPU that serving costs outside the engines: the simulator's
``serving_cpu_per_request_s``, ``serving_cpu_per_token_s`` and ``kv_copy_cpu_per_block_s``
on ``cpu-local``, which compete with the workers for the cores under ``sim --host-cores``.

A real ``splitserve serve`` (the router and one worker of one thread with the validation
runs' 0.06 GB pool, as ``bench compare`` starts them) plays the agentic workload of the
validation runs, closed loop, one session at a time so nothing queues: with its output
lengths, with them ``--longer`` times longer, and then with a 2 GB host-RAM KV tier, whose
mover thread saves every completed block and loads evicted prefixes back. Each run reads
the CPU counters ``splitserve bench`` reports (the worker process, its engine thread's
steps, the router, the load generator) and the tier's blocks saved and loaded; serving is
all of it but the engine thread's steps. Three runs, three unknowns: the CPU per request,
per generated token and per block copied.

    .venv/bin/python benchmarks/serving_cpu.py [--calibration benchmarks/out/cal-s9.json]

``--calibration FILE`` writes the figures into a ``sim calibrate`` file's fit.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import secrets

import numpy as np
from sim_speed_sensitivity import AGENTIC

from splitserve.bench.client import Endpoint
from splitserve.bench.compare import Running, stages_of
from splitserve.bench.deployments import DEPLOYMENTS
from splitserve.bench.load import run_load
from splitserve.bench.scrape import serving_cpu_seconds
from splitserve.cluster.local import free_port
from splitserve.workload.runs import Load
from splitserve.workload.sessions import LogNormal

# The validation runs' sessions, with short tool pauses: one session at a time, nothing idles.
WORKLOAD = dataclasses.replace(AGENTIC, tool_pause_s=LogNormal(0.05, 0.1))


FIGURES = ("serving_cpu_per_request_s", "serving_cpu_per_token_s", "kv_copy_cpu_per_block_s")


def fit(runs: list[tuple[float, ...]]) -> dict[str, float]:
    """The three figures from (requests, tokens, blocks copied, serving CPU seconds) runs."""
    a = np.array([run[:-1] for run in runs], dtype=float)
    b = np.array([run[-1] for run in runs])
    solution, *_ = np.linalg.lstsq(a, b, rcond=None)
    return dict(zip(FIGURES, (float(x) for x in solution), strict=True))


def play(name: str, workloads, duration_s: float) -> list[tuple[float, ...]]:
    """Each workload through a fresh deployment ``name``: (requests, tokens, blocks copied,
    serving CPU seconds) per run."""
    dep = DEPLOYMENTS[name]
    port, key = free_port(), secrets.token_hex(16)
    url = f"http://127.0.0.1:{port}"
    stages = stages_of(dep, 1, 1, port, key, ("--kv-cache-gb", "0.06"))
    load = Load(concurrency=1, duration_s=duration_s, drain_s=60.0)
    runs = []
    with Running(name, stages, 300.0):
        for workload in workloads:
            s = asyncio.run(run_load(Endpoint(url, key), workload, load, progress=False)).summary
            server, cpu = s.server, serving_cpu_seconds(s.server)
            blocks = server["kv_blocks_saved"] + server["kv_blocks_loaded"]
            runs.append((s.completed, s.total_output_tokens, blocks, cpu))
            print(
                f"{name}, {workload.describe()}: {s.completed} requests, "
                f"{s.total_output_tokens} tokens, {blocks:.0f} blocks copied; CPU s: engine "
                f"{server['engine_cpu_seconds']:.2f}, serving {cpu:.2f} (worker "
                f"{server['worker_cpu_seconds']:.2f}, router {server['router_cpu_seconds']:.2f}, "
                f"load generator {server['client_cpu_seconds']:.2f})",
                flush=True,
            )
    return runs


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
    runs = play("collocated-session", (WORKLOAD, longer), args.duration)
    runs += play("collocated-session-tiers", (WORKLOAD,), args.duration)
    figures = fit(runs)
    for name, value in figures.items():
        print(f"{name} {value:.5f}")
    if args.calibration:
        with open(args.calibration) as f:
            data = json.load(f)
        data["fit"].update({k: max(0.0, v) for k, v in figures.items()})
        with open(args.calibration, "w") as f:
            json.dump(data, f, indent=1)
        print(f"wrote them into {args.calibration}")


if __name__ == "__main__":
    main()
