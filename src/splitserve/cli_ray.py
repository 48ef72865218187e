"""The Ray flags of ``splitserve serve`` and the ``splitserve cluster`` commands."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.cluster.ray_plan import RayPlan
    from splitserve.cluster.serve import Topology

_ROLES = ("prefill", "decode", "router")


def add_ray_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("ray")
    g.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        default=None,
        metavar="ADDRESS",
        help="run the deployment on a Ray cluster (default auto: the one this machine "
        "belongs to, else a new local one); workers are replaced when they die",
    )
    _add_name_arg(g)
    g.add_argument("--routers", type=int, default=1, metavar="K", help="router replicas (--ray)")
    g.add_argument(
        "--cpus-per-worker",
        type=float,
        default=None,
        metavar="C",
        help="Ray CPUs each worker reserves (default: --threads-per-worker, else 1)",
    )
    g.add_argument("--gpus-per-worker", type=float, default=0.0, metavar="G")
    g.add_argument(
        "--node-label",
        action="append",
        default=[],
        metavar="ROLE:KEY=VALUE",
        help="run ROLE (prefill, decode, router) only on nodes with this Ray label "
        "(`ray start --labels KEY=VALUE`); repeatable",
    )

    a = p.add_argument_group("autoscale (--ray)")
    a.add_argument(
        "--autoscale",
        action="store_true",
        help="pick the prefill:decode split from the workers' metrics and the simulator",
    )
    a.add_argument("--autoscale-slo", default="ttft:1000,tpot:250", metavar="SLO")
    a.add_argument("--autoscale-interval", type=float, default=30.0, metavar="SECONDS")
    a.add_argument(
        "--autoscale-patience",
        type=int,
        default=2,
        metavar="N",
        help="a better split must win N decisions in a row before the pools resize (default 2)",
    )
    a.add_argument("--autoscale-hardware", default="cpu-local", metavar="PROFILE")
    a.add_argument(
        "--autoscale-calibration", default=None, metavar="FILE", help="a `sim calibrate` file"
    )
    a.add_argument(
        "--autoscale-host-cores",
        type=int,
        default=None,
        metavar="N",
        help="the simulated workers share N cores (workers on one machine); default: each "
        "has its own",
    )


def _autoscale_args(args: argparse.Namespace, topology: Topology) -> dict | None:
    """The planner's arguments, or None without ``--autoscale``."""
    if not args.autoscale:
        return None
    from splitserve.workload.metrics import SLO

    if topology.prefill + topology.decode < 2:
        raise ValueError("--autoscale splits the workers between the pools: it needs >= 2")
    if not args.autoscale_interval > 0:
        raise ValueError(f"--autoscale-interval must be > 0, got {args.autoscale_interval}")
    if args.autoscale_patience < 1:
        raise ValueError(f"--autoscale-patience must be >= 1, got {args.autoscale_patience}")
    return {
        "slo": SLO.parse(args.autoscale_slo),
        "hardware": args.autoscale_hardware,
        "calibration": args.autoscale_calibration,
        "host_cores": args.autoscale_host_cores,
        "remote_prefill_threshold": args.remote_prefill_threshold,
        "patience": args.autoscale_patience,
    }


def _add_name_arg(p) -> None:
    p.add_argument(
        "--ray-name",
        default="splitserve",
        metavar="NAME",
        help="the deployment's name on the cluster (default splitserve)",
    )


def node_labels(specs: list[str]) -> dict[str, dict[str, str]]:
    """``ROLE:KEY=VALUE`` flags as a label selector per role."""
    out: dict[str, dict[str, str]] = {}
    for spec in specs:
        role, _, pair = spec.partition(":")
        key, eq, value = pair.partition("=")
        if role not in _ROLES or not eq or not key or not value:
            raise ValueError(
                f"--node-label {spec!r}: expected ROLE:KEY=VALUE, ROLE one of {', '.join(_ROLES)}"
            )
        out.setdefault(role, {})[key] = value
    return out


def ray_plan(
    args: argparse.Namespace,
    topology: Topology,
    worker_args: list[str],
    api_key: str | None,
    keys_file: str | None,
) -> RayPlan:
    """The ``RayPlan`` of ``serve --ray``'s arguments (bad combinations: ValueError)."""
    from splitserve.cluster.ray_plan import RayPlan

    if not topology.decode:  # one collocated worker, behind a router like every Ray deployment
        topology.decode = 1
    env = {"SPLITSERVE_KV_SECRET": secrets.token_hex(32)}
    if api_key:
        env["SPLITSERVE_API_KEY"] = api_key
    if keys_file:
        env["SPLITSERVE_API_KEYS"] = os.path.abspath(keys_file)  # the same path on every node
        if topology.engine == "vllm":  # vLLM takes one key, which only the routers hold
            env["SPLITSERVE_API_KEY"] = secrets.token_urlsafe(32)
    cpus = args.cpus_per_worker or topology.threads_per_worker or 1
    return RayPlan(
        topology=topology,
        model=args.model,
        worker_args=worker_args,
        env=env,
        admin_key=api_key or secrets.token_urlsafe(24),
        routers=args.routers,
        router_port=None if args.port == 0 else args.port,
        cpus_per_worker=cpus,
        gpus_per_worker=args.gpus_per_worker,
        labels=node_labels(args.node_label),
        ready_timeout=args.ready_timeout,
        autoscale=_autoscale_args(args, topology),
        autoscale_interval=args.autoscale_interval,
        tls=args.tls,
    )


def cmd_serve_ray(args: argparse.Namespace, plan: RayPlan) -> int:
    from splitserve.cluster.ray_serve import serve_on_ray

    return serve_on_ray(args.ray, plan, args.ray_name)


def add_cluster_parser(sub) -> None:
    p = sub.add_parser("cluster", help="inspect or resize a deployment on a Ray cluster")
    csub = p.add_subparsers(dest="cluster_command", required=True)
    status = csub.add_parser("status", help="nodes and processes of a deployment")
    scale = csub.add_parser("scale", help="resize a deployment's pools (removed workers drain)")
    for q in (status, scale):
        q.add_argument(
            "--ray", default="auto", metavar="ADDRESS", help="the cluster (default auto)"
        )
        _add_name_arg(q)
    status.add_argument("--json", action="store_true", help='{"nodes": [...], "workers": [...]}')
    status.add_argument(
        "--watch",
        type=float,
        default=None,
        metavar="SECONDS",
        help="print the status again every SECONDS until interrupted (with --json: one "
        "document per line)",
    )
    status.set_defaults(func=cmd_cluster_status)
    scale.add_argument("--prefill", type=int, default=None, metavar="N")
    scale.add_argument("--decode", type=int, default=None, metavar="M")
    scale.set_defaults(func=cmd_cluster_scale)


def cmd_cluster_status(args: argparse.Namespace) -> int:
    import ray

    from splitserve.cluster.ray_serve import connect, controller, status, status_table

    if args.watch is not None and not args.watch > 0:
        raise ValueError(f"--watch must be > 0 seconds, got {args.watch}")
    out = _stdout_for_answers_only()
    connect(args.ray, join_only=True)
    ctrl = controller(args.ray_name)
    while True:
        try:
            data = status(ctrl)
        except ray.exceptions.RayActorError:
            print(f"splitserve: the deployment {args.ray_name!r} has stopped", file=sys.stderr)
            return 1
        if args.watch is None:
            print(json.dumps(data, indent=2) if args.json else status_table(data), file=out)
            out.flush()
            return 0
        if args.json:
            print(json.dumps(data), file=out)
        else:
            print(f"{time.strftime('%H:%M:%S')}\n{status_table(data)}\n", file=out)
        out.flush()
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0


def _stdout_for_answers_only():
    """A stream to this process's standard output; everything else printed from here on,
    Ray's threads and native code included, goes to standard error."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def cmd_cluster_scale(args: argparse.Namespace) -> int:
    import ray

    from splitserve.cluster.ray_serve import connect, controller

    if args.prefill is None and args.decode is None:
        raise ValueError("give --prefill N and/or --decode M")
    connect(args.ray, join_only=True)
    try:
        sizes = ray.get(controller(args.ray_name).scale.remote(args.prefill, args.decode))
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, ValueError):
            raise e.cause from None
        raise
    print(f"splitserve: scaling to prefill {sizes['prefill']}, decode {sizes['decode']}")
    return 0
