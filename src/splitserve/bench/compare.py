"""``splitserve bench compare``: deployments side by side, on the same cores, same workload.

Each deployment is a ``splitserve serve`` process (router in front of its worker pools,
started and stopped with ``cluster.local``), given the same number of workers at the same
threads per worker, so they share the machine's cores the same way. Runs go one deployment
at a time through every load of the sweep; each load replays its own seed (seed + i), so no
run finds an earlier one's conversations cached. The table puts every figure next to its
ratio to the first deployment at the same load.

``--repeats N`` runs the whole list N times over, interleaved (A, B, A, B, ...), each time
with the same seeds: a shared machine's noise then falls on every deployment alike, and a
second table gives each deployment's mean, min and max over the repeats with the ratio of
its mean to the baseline's mean.

Deployments are data: adding one is one entry in ``DEPLOYMENTS``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import secrets
import sys
import threading
from pathlib import Path

from splitserve.bench.client import Endpoint
from splitserve.bench.deployments import DEPLOYMENTS, Deployment, parse_deployments
from splitserve.bench.load import run_load
from splitserve.cluster.local import LocalDeployment, WorkerProcess, free_port, worker_argv
from splitserve.cluster.serve import Topology
from splitserve.workload.args import loads_from_args, workload_from_args, write_outputs
from splitserve.workload.metrics import SLO, Summary
from splitserve.workload.report import MEAN_HEADERS, markdown_table, mean_rows, rows, text_table
from splitserve.workload.runs import Load, RunResult


def add_compare_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("deployments")
    g.add_argument(
        "--deployments",
        default="collocated-rr,collocated-session,disagg-session",
        help=f"comma-separated, the first is the baseline; known: {', '.join(DEPLOYMENTS)}",
    )
    g.add_argument("--cores", type=int, default=2, help="total model threads per deployment")
    g.add_argument("--threads-per-worker", type=int, default=1)
    g.add_argument("--markdown", default=None, metavar="FILE", help="write the table as markdown")
    g.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more `splitserve serve` argument for every deployment (repeatable)",
    )
    g.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="N",
        help="run the deployments N times, interleaved, and add a table of their means",
    )
    g.add_argument("--ready-timeout", type=float, default=300.0)
    g.add_argument(
        "--step-logs",
        default=None,
        metavar="DIR",
        help="every worker logs its engine steps under DIR/<deployment>/ "
        "(for `splitserve sim calibrate --from-steps`)",
    )


def serve_argv(dep: Deployment, workers: int, threads: int, port: int, extra=()) -> list[str]:
    prefill, decode = dep.pools(workers)
    argv = [sys.executable, "-m", "splitserve.cli", "serve", "--port", str(port)]
    argv += ["--prefill", str(prefill), "--decode", str(decode)]
    argv += ["--threads-per-worker", str(threads), *_engine_args(dep), *dep.serve_args, *extra]
    return argv


def _engine_args(dep: Deployment) -> list[str]:
    return ["--engine", dep.engine] if dep.engine != "builtin" else []


def stages_of(
    dep: Deployment, workers: int, threads: int, port: int, key: str, extra=()
) -> list[LocalDeployment]:
    """The processes of ``dep`` on ``port``, in start order (workers before a front)."""
    url, env = f"http://127.0.0.1:{port}", {"SPLITSERVE_API_KEY": key}
    if dep.front == "splitserve":
        argv = serve_argv(dep, workers, threads, port, extra)
        return [LocalDeployment([WorkerProcess(dep.name, argv, url, env)])]
    if dep.engine == "llamacpp":
        return [LocalDeployment([_llamacpp_process(dep, workers * threads, port)])]
    if dep.front == "none":
        cores = ["--threads", str(workers * threads)] if dep.bind_all else []
        argv = worker_argv("127.0.0.1", port, None, [*_engine_args(dep), *cores, *extra])
        return [LocalDeployment([WorkerProcess(dep.name, argv, url, env)])]
    return _behind_vllm_router(dep, workers, threads, port, env, extra)


def _llamacpp_process(dep: Deployment, threads: int, port: int) -> WorkerProcess:
    from splitserve.cluster import llamacpp
    from splitserve.models.loader import default_model_path

    python = llamacpp.find_llamacpp_python()
    argv = llamacpp.llamacpp_argv(python, default_model_path(), "127.0.0.1", port, threads)
    url = f"http://127.0.0.1:{port}"
    return WorkerProcess(dep.name, argv, url, health_path=llamacpp.HEALTH_PATH)


def _behind_vllm_router(dep: Deployment, workers: int, threads: int, port: int, env, extra):
    from splitserve.cluster.vllm_router import find_vllm_router, vllm_router_argv, vllm_router_env
    from splitserve.cluster.vllm_worker import VLLM_CPU_BLOCK_SIZE, served_name
    from splitserve.models.loader import default_model_path

    binary = find_vllm_router()
    topology = Topology(decode=workers, threads_per_worker=threads, engine=dep.engine)
    pool, sources = [], []
    for i in range(workers):
        wport = free_port()
        args = [*_engine_args(dep), *topology.core_args(i), *extra]
        if dep.front_policy == "kv_aware":  # it reads the workers' KV events too
            events = f"tcp://127.0.0.1:{free_port()}"
            args += ["--kv-events-endpoint", events]
            sources += ["--kv-event-source", f"http://127.0.0.1:{wport}={events}"]
        argv = worker_argv("127.0.0.1", wport, None, args, role=topology.worker_role("decode"))
        pool.append(WorkerProcess(f"{dep.name}-{i}", argv, f"http://127.0.0.1:{wport}", env))
    if sources:
        sources += ["--kv-event-model", served_name(default_model_path())]
        sources += ["--kv-event-block-size", str(VLLM_CPU_BLOCK_SIZE)]
    assert dep.front_policy is not None
    urls = [w.url for w in pool]
    argv = vllm_router_argv(binary, "127.0.0.1", port, urls, dep.front_policy, sources)
    router = WorkerProcess(dep.name, argv, f"http://127.0.0.1:{port}", vllm_router_env())
    return [LocalDeployment(pool), LocalDeployment([router])]


class Running:
    """A deployment's processes, started (in stages) and stopped as a context."""

    def __init__(self, name: str, stages: list[LocalDeployment], timeout: float):
        self.name, self.stages, self.timeout = name, stages, timeout

    def __enter__(self) -> Running:
        for i, stage in enumerate(self.stages):
            if not stage.start(self.timeout, threading.Event()):
                for started in reversed(self.stages[: i + 1]):
                    started.stop()
                raise RuntimeError(f"{self.name} did not become healthy")
        return self

    def __exit__(self, *exc) -> None:
        for stage in reversed(self.stages):
            stage.stop(timeout=30.0)


Series = dict[str, list[tuple[Load, RunResult]]]  # deployment -> [(load, run)]


def compare(args: argparse.Namespace, workload, loads: list[Load], slo: SLO) -> list[Series]:
    """Every deployment through every load, ``args.repeats`` times over; one series per
    repeat."""
    deps = parse_deployments(args.deployments)
    if args.cores % args.threads_per_worker:
        raise ValueError("--cores must be a multiple of --threads-per-worker")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    workers = args.cores // args.threads_per_worker
    for dep in deps:
        dep.pools(workers)  # fail fast on a deployment that cannot be built
    return [
        {dep.name: _sweep_one(args, dep, workers, workload, loads, slo) for dep in deps}
        for _ in range(args.repeats)
    ]


def _sweep_one(args, dep: Deployment, workers: int, workload, loads: list[Load], slo: SLO):
    port, key = free_port(), secrets.token_hex(16)
    url = f"http://127.0.0.1:{port}"
    extra = list(args.serve_arg)
    if args.step_logs:
        extra += ["--step-log-dir", os.path.join(args.step_logs, dep.name)]
    stages = stages_of(dep, workers, args.threads_per_worker, port, key, extra)
    argv = stages[-1].workers[0].argv
    out = []
    with Running(dep.name, stages, args.ready_timeout):
        for i, load in enumerate(loads):
            wl = dataclasses.replace(workload, seed=workload.seed + i)
            endpoint = _endpoint(dep, url, key)
            run = asyncio.run(run_load(endpoint, wl, load, slo, not args.no_progress))
            run.summary.info["deployment"] = f"{dep.name}: {dep.about}; {' '.join(argv[4:])}"
            out.append((load, run))
            s = run.summary
            print(
                f"{dep.name} {load.describe()}: goodput {s.request_goodput:.3f} req/s, "
                f"session goodput {s.session_goodput:.3f}/s, TTFT p50 {s.ttft.median:.0f} ms, "
                f"TPOT p50 {s.tpot.median:.0f} ms, failed {s.failed}",
                flush=True,
            )
    return out


def _endpoint(dep: Deployment, url: str, key: str) -> Endpoint:
    if dep.engine != "llamacpp":
        return Endpoint(url, key)
    from splitserve.cluster.llamacpp import eos_logit_bias
    from splitserve.models.loader import default_model_path

    bias = eos_logit_bias(default_model_path())
    return Endpoint(url, key, strict_openai=True, logit_bias=bias)


def run_compare(args: argparse.Namespace) -> int:

    workload, loads = workload_from_args(args), loads_from_args(args)
    slo = SLO.parse(args.slo, args.session_slo)
    print(f"{workload.describe()}; SLO {slo.describe()}; {args.cores} cores", flush=True)
    repeats = compare(args, workload, loads, slo)
    runs = [
        (name, _label(ld, k, len(repeats)), r.summary)
        for k, series in enumerate(repeats, 1)
        for name, rs in series.items()
        for ld, r in rs
    ]
    per_run = rows(runs, ratios=True)
    tables, markdown = [text_table(per_run)], [markdown_table(per_run)]
    if len(repeats) > 1:
        means = mean_rows(_over_repeats(repeats))
        tables.append(text_table(means, MEAN_HEADERS))
        markdown.append(markdown_table(means, MEAN_HEADERS))
    print("\n\n".join(tables))
    if args.markdown:
        Path(args.markdown).write_text("\n\n".join(markdown) + "\n")
        print(f"wrote {args.markdown}", file=sys.stderr)
    write_outputs(args, *repeats)
    return 0


def _label(load: Load, k: int, repeats: int) -> str:
    return load.describe() if repeats == 1 else f"{load.describe()}, run {k}"


def _over_repeats(repeats: list[Series]) -> list[tuple[str, str, list[Summary]]]:
    """(deployment, load, its summaries over the repeats), in the first repeat's order."""
    return [
        (name, load.describe(), [series[name][i][1].summary for series in repeats])
        for name, runs in repeats[0].items()
        for i, (load, _) in enumerate(runs)
    ]
