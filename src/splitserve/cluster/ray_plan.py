"""What a Ray deployment runs, and how each of its processes is placed and started: the
Ray options of its actor, the ports it takes on its node, its command line."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splitserve.cluster.local import own_access_log, own_disk_dir, router_argv, worker_argv
from splitserve.cluster.serve import Topology
from splitserve.common.kv_events import source

ROUTER = "router"


@dataclass(slots=True)
class RayPlan:
    """What a Ray deployment runs. ``labels``: a label selector per role (``prefill``,
    ``decode``, ``router``) for the nodes it may run on."""

    topology: Topology
    model: str | None = None
    worker_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    admin_key: str = ""
    routers: int = 1
    router_port: int | None = None  # every replica binds it on its own node; None: free ports
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    labels: dict[str, dict[str, str]] = field(default_factory=dict)
    ready_timeout: float = 600.0
    drain_timeout: float = 120.0
    autoscale: dict[str, Any] | None = None  # cluster.autoscale.Planner's arguments
    autoscale_interval: float = 30.0
    tls: bool = False  # every HTTP leg HTTPS, by a CA the controller makes (cluster.tls)

    def __post_init__(self) -> None:
        if self.routers < 1:
            raise ValueError(f"--routers must be >= 1, got {self.routers}")
        if self.topology.decode < 1:
            raise ValueError("a Ray deployment needs decode workers (--decode M, M >= 1)")


@dataclass(slots=True)
class Slot:
    """One process of the deployment. ``state``: starting, ready, retiring (removed, still
    serving until no worker starts), draining or stopped."""

    name: str
    role: str
    actor: Any = None
    info: dict[str, Any] = field(default_factory=dict)
    state: str = "starting"
    restarts: int = 0
    idle_checks: int = 0
    since: float = 0.0  # when it was launched, then when its drain began
    placing: Any = None  # the actor's node() call while Ray places it
    prefer: dict[str, Any] | None = None  # where it ran before, for its replacement

    @property
    def url(self) -> str | None:
        if "ip" not in self.info:
            return None
        scheme = "https" if self.info.get("tls") else "http"
        return f"{scheme}://{self.info['ip']}:{self.info['ports']['port']}"

    @property
    def events(self) -> str | None:
        """Where a decode worker publishes its KV events (the kv-events policy)."""
        ports = self.info.get("ports", {})
        if ports.get("events") is None:
            return None
        ip = self.info["ip"]
        replay = None if ports.get("replay") is None else f"tcp://{ip}:{ports['replay']}"
        return source(f"tcp://{ip}:{ports['events']}", replay)


def binds_router_port(plan: RayPlan, slot: Slot) -> bool:
    """Replicas on nodes of their own (a router label) all bind ``--port``; on the head,
    only the first does, the others take free ports."""
    if plan.router_port is None:
        return False
    return slot.name == f"{ROUTER}-0" or bool(plan.labels.get(ROUTER))


def actor_options(plan: RayPlan, role: str, prefer: dict[str, Any] | None) -> dict[str, Any]:
    """Ray options for an actor of ``role``: its CPUs/GPUs and label, and where: ``prefer``'s
    node if it still lives, else the head for a router, spread across nodes for a worker."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    opts: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0}
    if role != ROUTER:
        opts["num_cpus"] = plan.cpus_per_worker
        opts["num_gpus"] = plan.gpus_per_worker
    label = plan.labels.get(role)
    if label:
        opts["label_selector"] = dict(label)
    node = None if prefer is None else prefer.get("node_id")
    if node is not None and node not in alive_nodes():
        node = None  # that node is gone: placed as if new
    if node is None and role == ROUTER and not label:
        node = head_node()
    # Hard affinity: a soft one to a live node was seen to land elsewhere (Ray 2.60).
    if node is not None:
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
    elif role != ROUTER:
        opts["scheduling_strategy"] = "SPREAD"
    return opts


def slot_ports(plan: RayPlan, slot: Slot) -> dict[str, int | None]:
    """The ports a new process of ``slot`` takes (None: a free one of its node)."""
    ports: dict[str, int | None] = {"port": None}
    t = plan.topology
    if slot.role == "decode" and t.kv_events_tokenizer is not None:
        ports["events"] = None
        ports["replay"] = None
    if t.engine == "vllm" and t.prefill and slot.role != ROUTER:
        ports["kv"] = None
    return ports


def slot_command(
    plan: RayPlan, slot: Slot, workers: dict[str, str], events: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    """``slot``'s command line (``{host}`` and ports left for its node) and environment;
    ``workers``: URL -> role of the workers a router starts with, ``events``: URL -> KV
    events endpoint of those that publish them. With ``plan.tls`` every process serves
    HTTPS with the files its host writes to ``{files}``."""
    t = plan.topology
    env = dict(plan.env)
    tls = _TLS_ARGS if plan.tls else []
    # vLLM knows no tenants: under a keys file its workers take the one key the plan made
    # for them, which only the routers hold (as SPLITSERVE_WORKER_API_KEY).
    vllm_keys = t.engine == "vllm" and "SPLITSERVE_API_KEYS" in env
    if slot.role == ROUTER:
        prefill = [u for u, r in workers.items() if r == "prefill"]
        decode = [u for u, r in workers.items() if r != "prefill"]
        args = [*t.router_args, "--disaggregate"]
        if t.kv_events_tokenizer is not None:
            args += ["--tokenizer", t.kv_events_tokenizer]
            args += [f"--kv-events={url}={endpoint}" for url, endpoint in events.items()]
        if t.engine == "vllm":
            args += ["--worker-engine", "vllm"]
        env["SPLITSERVE_ADMIN_KEY"] = plan.admin_key
        if "SPLITSERVE_API_KEY" in env:
            env["SPLITSERVE_WORKER_API_KEY"] = env["SPLITSERVE_API_KEY"]
        if vllm_keys:
            del env["SPLITSERVE_API_KEY"]  # clients authenticate by the keys file alone
        return router_argv("{host}", "{port}", prefill, decode, [*args, *tls]), env
    if vllm_keys:
        del env["SPLITSERVE_API_KEYS"]
    index = int(slot.name.rsplit("-", 1)[1]) + (t.prefill if slot.role == "decode" else 0)
    args = [*plan.worker_args, *t.core_args(index, this_machine=False), *t.role_args(slot.role)]
    args = own_access_log(own_disk_dir(args, slot.name), slot.name)
    if slot.role == "decode" and t.kv_events_tokenizer is not None:
        args += ["--kv-events-endpoint", "tcp://{host}:{events}"]
        args += ["--kv-events-replay-endpoint", "tcp://{host}:{replay}"]
    if t.engine == "vllm" and t.prefill:
        args += ["--kv-port", "{kv}"]
    role = t.worker_role(slot.role)
    return worker_argv("{host}", "{port}", plan.model, [*args, *tls], role=role), env


# What ProcessHost writes to {files} (cluster.tls.DeploymentCA.issue's names).
_TLS_ARGS = [
    *("--ssl-certfile", "{files}/server.pem", "--ssl-keyfile", "{files}/server.key"),
    *("--worker-ca", "{files}/ca.pem"),
]


def head_node() -> str | None:
    """The node id of the cluster's head."""
    import ray

    for node in ray.nodes():
        if node["Alive"] and "node:__internal_head__" in node["Resources"]:
            return node["NodeID"]
    return None


def alive_nodes() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}
