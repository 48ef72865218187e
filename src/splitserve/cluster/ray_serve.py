"""``splitserve serve --ray`` and ``splitserve cluster``: a deployment's controller as a named
Ray actor, and the commands that find it.

``serve --ray`` joins the cluster (``auto``: the one this machine belongs to, else a new
local one), starts the controller (``cluster.ray_deploy``) on its own node and waits until
stopped; the controller is owned by this process, so when it ends, however it ends, Ray ends
the controller and with it every worker and router replica. ``cluster status`` and
``cluster scale`` reach the controller by name from any machine of the cluster.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import sys
import time
from typing import Any

import httpx

from splitserve.cluster.local import StopFlag
from splitserve.cluster.ray_deploy import Controller, worker_load
from splitserve.cluster.ray_plan import ROUTER, RayPlan, head_node
from splitserve.common.tls import client_context

NAMESPACE = "splitserve"
DEFAULT_NAME = "splitserve"


def connect(address: str, log_to_driver: bool = False, join_only: bool = False) -> bool:
    """Join the Ray cluster at ``address`` (``auto``: this machine's, else start a local
    one unless ``join_only``); True when this call started that cluster."""
    import ray

    kwargs: dict[str, Any] = {"namespace": NAMESPACE, "log_to_driver": log_to_driver}
    if address != "auto" and not _answers(address):
        hint = "start one with `ray start --head`"
        raise ValueError(f"no Ray cluster answers at {address} ({hint})")
    try:
        ray.init(address=address, **kwargs)
        return False
    except ConnectionError:
        if address != "auto" or join_only:
            hint = "start one with `ray start --head`"
            raise ValueError(f"no Ray cluster at {address} ({hint})") from None
    ray.init(include_dashboard=False, **kwargs)
    return True


def _answers(address: str, timeout: float = 3.0) -> bool:
    """Whether a TCP server listens at ``HOST:PORT`` (``ray.init`` would retry for minutes)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def controller(name: str):
    """The named controller of a running deployment; ValueError when there is none."""
    import ray

    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        raise ValueError(f"no splitserve deployment named {name!r} on this Ray cluster") from None


def serve_on_ray(address: str, plan: RayPlan, name: str = DEFAULT_NAME) -> int:
    """Run ``plan`` on the cluster until SIGINT/SIGTERM; the process exit code."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    started = connect(address, log_to_driver=True)
    stop = StopFlag()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    here = NodeAffinitySchedulingStrategy(head_node(), soft=False)  # it outlives worker nodes
    actor = ray.remote(Controller).options(
        name=name, num_cpus=0, max_concurrency=16, scheduling_strategy=here
    )
    ca_dir = None
    try:
        try:
            ctrl = actor.remote(plan)
        except ValueError as e:  # the name is taken
            raise ValueError(f"a deployment named {name!r} already runs on this cluster") from e
        try:
            urls = ray.get(ctrl.start.remote())
        except ray.exceptions.RayTaskError as e:
            print(f"splitserve: {e.cause}", file=sys.stderr)
            return 1
        ca_dir = _write_ca(ray.get(ctrl.ca_pem.remote()))
        if ca_dir is not None:
            ca = os.path.join(ca_dir, "ca.pem")
            print(
                f"splitserve: TLS with a private CA for this run; clients trust {ca}, "
                f"e.g. SSL_CERT_FILE={ca} (removed when serving stops)",
                flush=True,
            )
        for url in urls:
            print(f"splitserve: serving the OpenAI API at {url}/v1 (Ctrl-C to stop)", flush=True)
        while not stop.wait(1.0):
            try:
                ray.get(ctrl.sizes.remote(), timeout=60)
            except ray.exceptions.RayActorError:
                print("splitserve: the deployment's controller died", file=sys.stderr)
                return 1
        return 0
    finally:
        try:
            ray.get(ctrl.stop.remote(), timeout=120)
        except Exception:
            pass  # killing the actor below still ends every process it owns
        try:
            ray.kill(ctrl)
        except Exception:
            pass
        for s, handler in previous.items():
            signal.signal(s, handler)
        if ca_dir is not None:
            shutil.rmtree(ca_dir, ignore_errors=True)
        if started:
            ray.shutdown()


def _write_ca(pem: bytes | None) -> str | None:
    """The deployment's CA certificate in a new private directory (None: no TLS)."""
    if pem is None:
        return None
    from splitserve.cluster.tls import write_private

    return write_private({"ca.pem": pem})


def status(ctrl) -> dict[str, list[dict[str, Any]]]:
    """``{"time", "nodes", "workers", "routers", "decisions", "events"}``: when it was read (Unix
    seconds), the cluster's nodes, and every process with its node, url, role, pid and state;
    workers also with load, KV use and sessions; the autoscaler's decisions; the controller's
    last 100 events (replacements, resizes, drains, decisions)."""
    import ray

    started = time.time()

    nodes = [
        {
            "node_id": n["NodeID"],
            "ip": n["NodeManagerAddress"],
            "alive": n["Alive"],
            "cpus": n["Resources"].get("CPU", 0),
            "gpus": n["Resources"].get("GPU", 0),
            "labels": {k: v for k, v in n.get("Labels", {}).items() if not k.startswith("ray.io")},
        }
        for n in ray.nodes()
    ]
    slots = ray.get(ctrl.slots.remote(), timeout=30)
    admin_key, worker_key = ray.get(ctrl.keys.remote(), timeout=30)
    pem = ray.get(ctrl.ca_pem.remote(), timeout=30)
    verify = True if pem is None else client_context(cadata=pem)
    routers = [s for s in slots if s["role"] == ROUTER]
    workers = [s for s in slots if s["role"] != ROUTER]
    sessions: dict[str, int] = {}
    indexed: dict[str, int] = {}  # with --policy kv-events: blocks a router's index holds
    for router in routers:
        for w in _get(router["url"], "/workers", admin_key, verify).get("workers", []):
            sessions[w["url"]] = sessions.get(w["url"], 0) + w.get("sessions", 0)
            if "kv_blocks_indexed" in w:
                indexed[w["url"]] = max(indexed.get(w["url"], 0), w["kv_blocks_indexed"])
    for w in workers:
        load = (worker_load(w["url"], worker_key, verify) if w["url"] else None) or {}
        w.update(
            running=load.get("running"),
            waiting=load.get("waiting"),
            kv_usage=load.get("kv_usage"),
            sessions=sessions.get(w["url"], 0),
        )
        if w["url"] in indexed:
            w["kv_blocks_indexed"] = indexed[w["url"]]
    decisions = ray.get(ctrl.decisions.remote(), timeout=30)
    events = ray.get(ctrl.events.remote(), timeout=30)[-100:]
    return {
        "time": started,
        "nodes": nodes,
        "workers": workers,
        "routers": routers,
        "decisions": decisions,
        "events": events,
    }


def _get(
    base: str | None, path: str, key: str | None, verify: ssl.SSLContext | bool = True
) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.get(f"{base}{path}", headers=headers, timeout=5, verify=verify)
        return r.json() if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


def status_table(data: dict[str, list[dict[str, Any]]]) -> str:
    """``status``'s answer as aligned text tables."""
    node_rows = [
        [n["ip"], n["node_id"][:12], "alive" if n["alive"] else "dead", f"{n['cpus']:g}",
         f"{n['gpus']:g}", ",".join(f"{k}={v}" for k, v in n["labels"].items()) or "-"]
        for n in data["nodes"]
    ]  # fmt: skip
    proc_rows = [
        [p["name"], p["role"], p["node_ip"] or "-", p["url"] or "-", str(p["pid"] or "-"),
         p["state"], str(p["restarts"]), _num(p.get("running")), _num(p.get("waiting")),
         _pct(p.get("kv_usage")), _num(p.get("sessions"))]
        for p in [*data["workers"], *data["routers"]]
    ]  # fmt: skip
    heads = (
        ["node", "id", "state", "cpus", "gpus", "labels"],
        ["name", "role", "node", "url", "pid", "state", "restarts", "running", "waiting", "kv",
         "sessions"],
    )  # fmt: skip
    tables = zip(heads, (node_rows, proc_rows), strict=True)
    return "\n\n".join(_table(h, rows) for h, rows in tables)


def _num(v: Any) -> str:
    return "-" if v is None else str(v)


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *rows])
    return "\n".join(line.rstrip() for line in lines)
