"""Serving a deployment on this host: its topology (one collocated worker, or P/D pools
behind the router), the worker and router processes it starts, and their wait until stopped.

With ``tls`` every HTTP leg is HTTPS: the launcher makes a private CA and one server
certificate (``cluster.tls``), every worker and the router serve with it and verify each
other against the CA, and the launcher's own readiness polls trust only that CA.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.cluster.local import (
    LocalDeployment,
    StopFlag,
    WorkerProcess,
    free_port,
    own_access_log,
    own_disk_dir,
    router_argv,
    worker_argv,
)
from splitserve.common.kv_events import source
from splitserve.common.protocol import DEFAULT_KV_PEER_TIMEOUT_S

if TYPE_CHECKING:
    from splitserve.cluster.tls import DeploymentTLS


@dataclass(slots=True)
class Topology:
    """What to start: one collocated worker (the default), or prefill and decode pools
    behind the router. ``threads_per_worker`` keeps the pools from fighting over cores."""

    prefill: int = 0
    decode: int = 0
    threads_per_worker: int | None = None
    kv_transport: str = "tcp"
    kv_peer: bool = False  # decode workers lend each other sessions' KV (worker.peer)
    kv_peer_timeout_s: float = DEFAULT_KV_PEER_TIMEOUT_S
    kv_encrypt: bool = False  # KV moving between workers is AES-GCM encrypted
    engine: str = "builtin"  # or "vllm": each worker a vLLM server (cluster.vllm_worker)
    # Set: decode workers publish KV events, the router places by them and tokenizes with
    # this model directory (--policy kv-events).
    kv_events_tokenizer: str | None = None
    router_args: Sequence[str] = ()

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 0:
            raise ValueError("--prefill and --decode must be >= 0")
        if self.prefill and not self.decode:
            raise ValueError("prefill workers need at least one decode worker (--decode M)")
        if self.kv_peer and not self.decode:
            raise ValueError("--kv-peer-fetch needs decode workers behind the router (--decode M)")
        if self.kv_encrypt and not self.decode:
            raise ValueError(
                "--kv-encrypt encrypts KV moving between workers; it needs pools (--decode M)"
            )
        if not self.kv_peer_timeout_s > 0:
            raise ValueError(f"--kv-peer-timeout must be > 0, got {self.kv_peer_timeout_s}")

    def core_args(self, index: int, this_machine: bool = True) -> list[str]:
        """The thread flags of the ``index``-th worker: it runs on cores of its own
        (``threads_per_worker`` of them, in turn, wrapping around this machine). A builtin
        worker placed elsewhere (``this_machine=False``: on a Ray node) gets threads, no cores."""
        threads = self.threads_per_worker
        if threads is None:
            return []
        ncpu = os.cpu_count() or 1
        cores = sorted({(index * threads + k) % ncpu for k in range(threads)})
        binding = ["--cpus", ",".join(map(str, cores))]
        if self.engine != "vllm":
            return ["--threads", str(threads), *(binding if this_machine else [])]
        return binding

    def worker_role(self, role: str) -> str:
        """The ``--role`` a worker of pool ``role`` runs with. A vLLM worker's role says
        whether it moves KV (NixlConnector), so a decode pool without prefill workers runs
        ``both``: the same whole-request servers as without the router."""
        if self.engine == "vllm" and not self.prefill:
            return "both"
        return role

    def role_args(self, role: str) -> list[str]:
        """Flags only the workers of ``role`` get."""
        if self.engine == "vllm":
            return []  # vLLM's KV moves by NixlConnector; peer fetch is builtin-only
        encrypt = ["--kv-encrypt"] if self.kv_encrypt else []
        if role == "prefill":
            return ["--kv-transport", self.kv_transport, *encrypt]
        if not self.kv_peer:
            return encrypt
        return ["--kv-peer", "--kv-peer-timeout", str(self.kv_peer_timeout_s), *encrypt]

    @property
    def disaggregated(self) -> bool:
        return self.decode > 0


def serve(
    host: str = "127.0.0.1",
    port: int = 8000,
    model: str | None = None,
    worker_args: Sequence[str] = (),
    api_key: str | None = None,
    ready_timeout: float = 600.0,
    topology: Topology | None = None,
    tls: bool = False,
    api_keys_file: str | None = None,
) -> int:
    """Run the deployment until SIGINT/SIGTERM; return the process exit code. ``tls``: every
    HTTP leg over HTTPS with a private CA made for this run (its files removed at the end)."""
    topology = topology or Topology()
    env = {"SPLITSERVE_API_KEY": api_key} if api_key else {}
    if api_keys_file:
        if topology.engine == "vllm" and not topology.disaggregated:
            raise ValueError(
                "--api-keys with --engine vllm needs the router in front (--decode N): "
                "a vLLM server alone knows no tenants"
            )
        env["SPLITSERVE_API_KEYS"] = os.path.abspath(api_keys_file)
    if not tls:
        return _serve(host, port, model, worker_args, env, ready_timeout, topology, None)
    from splitserve.cluster.tls import private_tls

    files = private_tls([host])
    try:
        return _serve(host, port, model, worker_args, env, ready_timeout, topology, files)
    finally:
        files.remove()


def _serve(
    host: str,
    port: int,
    model: str | None,
    worker_args: Sequence[str],
    env: dict[str, str],
    ready_timeout: float,
    topology: Topology,
    tls: DeploymentTLS | None,
) -> int:
    url = f"{_scheme(tls)}://{host}:{port}"
    if tls is not None:
        worker_args = [*worker_args, *tls.server_args()]
    if topology.disaggregated:
        builders = _pools(host, port, model, worker_args, env, topology, tls)
    else:
        argv = worker_argv(host, port, model, worker_args)
        worker = WorkerProcess("worker-0", argv, url, env, ca=_ca(tls))
        builders = [lambda: LocalDeployment([worker])]
    stop = StopFlag()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    stages: list[LocalDeployment] = []
    try:
        for build in builders:  # workers first, then the router in front of them
            stage = build()
            stages.append(stage)
            if not stage.start(ready_timeout, stop):
                if stop.is_set():
                    return 0
                names = ", ".join(w.name for w in stage.workers)
                print(f"splitserve: {names} did not become healthy", file=sys.stderr)
                return 1
        print(f"splitserve: serving the OpenAI API at {url}/v1 (Ctrl-C to stop)", flush=True)
        if tls is not None:
            print(
                f"splitserve: TLS with a private CA for this run; clients trust {tls.ca}, "
                f"e.g. SSL_CERT_FILE={tls.ca} (removed when serving stops)",
                flush=True,
            )
        for code in (stage.wait(stop) for stage in stages[-1:]):
            if code is not None:
                print(f"splitserve: a process exited with code {code}", file=sys.stderr)
                return 1
        return 0
    finally:
        for stage in reversed(stages):
            stage.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _kv_events_router_args(workers: list[WorkerProcess], topology: Topology) -> list[str]:
    """The router's ``--kv-events URL=ENDPOINT,REPLAY`` per publishing worker, and
    ``--tokenizer``."""
    if topology.kv_events_tokenizer is None:
        return []
    out = ["--tokenizer", topology.kv_events_tokenizer]
    for w in workers:
        if "--kv-events-endpoint" in w.argv:
            endpoint = w.argv[w.argv.index("--kv-events-endpoint") + 1]
            replay = w.argv[w.argv.index("--kv-events-replay-endpoint") + 1]
            out += ["--kv-events", f"{w.url}={source(endpoint, replay)}"]
    return out


def _pools(
    host: str,
    port: int,
    model: str | None,
    worker_args: Sequence[str],
    env: dict[str, str],
    topology: Topology,
    tls: DeploymentTLS | None = None,
) -> list[Callable[[], LocalDeployment]]:
    """Builders of two stages: prefill and decode workers on free ports sharing a fresh
    cluster secret, then the router on ``port``, made once the workers are up (a worker may
    have moved to another port); ``tls``: everyone serves HTTPS (``worker_args`` carry the
    flags)."""
    env = {**env, "SPLITSERVE_KV_SECRET": secrets.token_hex(32)}
    router_env = dict(env)
    if topology.engine == "vllm" and "SPLITSERVE_API_KEYS" in env:
        # vLLM knows no tenants: it takes one key, which only the router holds.
        env["SPLITSERVE_API_KEY"] = secrets.token_urlsafe(32)
    workers = pool_workers(host, model, worker_args, env, topology, tls)
    return [
        lambda: LocalDeployment(workers),
        lambda: LocalDeployment([_router(host, port, workers, env, router_env, topology, tls)]),
    ]


def _router(
    host: str,
    port: int,
    workers: list[WorkerProcess],
    env: dict[str, str],
    router_env: dict[str, str],
    topology: Topology,
    tls: DeploymentTLS | None,
) -> WorkerProcess:
    """The router on ``port`` in front of ``workers`` at their URLs now."""
    urls = {
        role: [w.url for w in workers if w.name.startswith(role)] for role in ("prefill", "decode")
    }
    router_args = [*topology.router_args, *_kv_events_router_args(workers, topology)]
    if topology.engine == "vllm":
        router_args += ["--worker-engine", "vllm"]
    if tls is not None:
        router_args += tls.server_args()
    if "SPLITSERVE_API_KEY" in env:
        router_env["SPLITSERVE_WORKER_API_KEY"] = env["SPLITSERVE_API_KEY"]
    argv = router_argv(host, port, urls["prefill"], urls["decode"], router_args)
    url = f"{_scheme(tls)}://{host}:{port}"
    return WorkerProcess("router", argv, url, router_env, ca=_ca(tls))


def pool_workers(
    host: str,
    model: str | None,
    worker_args: Sequence[str],
    env: dict[str, str],
    topology: Topology,
    tls: DeploymentTLS | None = None,
) -> list[WorkerProcess]:
    """The prefill then decode workers of ``topology``, each on a free port of ``host``
    (``https://`` URLs with ``tls``: ``worker_args`` carry its flags)."""
    workers: list[WorkerProcess] = []
    for role, count in (("prefill", topology.prefill), ("decode", topology.decode)):
        for i in range(count):
            wport = free_port(host)
            cores = topology.core_args(len(workers))
            args = [*worker_args, *cores, *topology.role_args(role)]
            args = own_access_log(own_disk_dir(args, f"{role}-{i}"), f"{role}-{i}")
            if role == "decode" and topology.kv_events_tokenizer is not None:
                args += ["--kv-events-endpoint", f"tcp://{host}:{free_port(host)}"]
                args += ["--kv-events-replay-endpoint", f"tcp://{host}:{free_port(host)}"]
            if topology.engine == "vllm" and topology.prefill:  # NixlConnector's side channel
                args += ["--kv-port", str(free_port(host))]
            argv = worker_argv(host, wport, model, args, role=topology.worker_role(role))
            url = f"{_scheme(tls)}://{host}:{wport}"
            w = WorkerProcess(f"{role}-{i}", argv, url, env, ca=_ca(tls), movable=True)
            workers.append(w)
    return workers


def _scheme(tls: DeploymentTLS | None) -> str:
    return "http" if tls is None else "https"


def _ca(tls: DeploymentTLS | None) -> str | None:
    return None if tls is None else tls.ca
