"""Start a deployment as local processes and stop every one of them on SIGINT/SIGTERM.

Each worker runs in its own session (so its own process group): a terminal's Ctrl-C reaches
only the launcher, which then stops each group as a whole, so nothing a worker started can
outlive it. On Linux a worker also gets SIGTERM if the launcher dies without cleaning up.

With ``tls`` every HTTP leg is HTTPS: the launcher makes a private CA and one server
certificate (``cluster.tls``), every worker and the router serve with it and verify each
other against the CA, and the launcher's own readiness polls trust only that CA.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING

import httpx

from splitserve.common.protocol import DEFAULT_KV_PEER_TIMEOUT_S
from splitserve.common.tls import client_context

if TYPE_CHECKING:
    from splitserve.cluster.tls import DeploymentTLS

POLL_S = 0.2


@dataclass(slots=True)
class WorkerProcess:
    """One worker subprocess and the URL it serves on."""

    name: str
    argv: list[str]
    url: str
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    health_path: str = "/health"  # a peer server without /health names another route
    ca: str | None = None  # an https:// url: the CA its certificate is verified against

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.argv,
            env={**os.environ, **self.env},
            start_new_session=True,
            preexec_fn=die_with_parent,
        )

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def healthy(self) -> bool:
        return healthy(self.url, self.health_path, self.ca)

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)  # its pgid is its pid: start_new_session
        except ProcessLookupError:
            pass


def healthy(url: str, path: str = "/health", ca: str | None = None) -> bool:
    """Whether the server at ``url`` answers ``path`` with 200; ``ca``: what an https://
    server's certificate is verified against (default: httpx's usual trust)."""
    verify: ssl.SSLContext | bool = True if ca is None else _ca_context(ca)
    try:
        return httpx.get(f"{url}{path}", timeout=2.0, verify=verify).status_code == 200
    except httpx.HTTPError:
        return False


@lru_cache(maxsize=4)
def _ca_context(ca: str) -> ssl.SSLContext:
    return client_context(ca)  # once per CA file, not once per readiness poll


def _sigterm_when_parent_ends() -> None:
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


# ``Popen(preexec_fn=die_with_parent)``: on Linux the child gets SIGTERM when the thread that
# started it ends, so a killed launcher or test leaves no worker behind; elsewhere None (no
# such call, and Windows refuses any preexec_fn).
die_with_parent: Callable[[], None] | None = (
    _sigterm_when_parent_ends if sys.platform == "linux" else None
)


def worker_argv(
    host: str, port: int, model: str | None, extra: Sequence[str] = (), role: str = "both"
) -> list[str]:
    """The command line of one worker."""
    argv = [sys.executable, "-m", "splitserve.cli", "worker", "--role", role]
    argv += ["--host", host, "--port", str(port)]
    if model is not None:
        argv += ["--model", model]
    return argv + list(extra)


def router_argv(host: str, port: int, prefill: list[str], decode: list[str], extra=()) -> list[str]:
    argv = [sys.executable, "-m", "splitserve.cli", "router", "--host", host, "--port", str(port)]
    argv += ["--decode", *decode, "--log-level", "warning"]
    if prefill:
        argv += ["--prefill", *prefill, "--disaggregate"]
    return argv + list(extra)


def own_disk_dir(args: list[str], name: str) -> list[str]:
    """Give a worker of a pool its own subdirectory of ``--disk-kv-dir``: a disk tier's
    index belongs to one process."""
    if "--disk-kv-dir" not in args:
        return args
    i = args.index("--disk-kv-dir") + 1
    return [*args[:i], os.path.join(args[i], name), *args[i + 1 :]]


def own_access_log(args: list[str], name: str) -> list[str]:
    """Give a worker of a pool its own access log, ``PATH.<name>``: a rotating file has one
    writer."""
    if "--access-log" not in args:
        return args
    i = args.index("--access-log") + 1
    return [*args[:i], f"{args[i]}.{name}", *args[i + 1 :]]


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the OS picks it; reuse races are unlikely)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class StopFlag:
    """A stop request that signal handlers set. ``threading.Event.set`` takes the event's
    lock, which the main thread holds for a moment inside ``Event.wait``: a signal landing
    then ran its handler on that thread, which waited for its own lock for ever (``serve``
    given SIGINT then SIGTERM hung so). Setting a bool takes no lock."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        """Sleep ``timeout`` unless set (signal handlers run during the sleep); whether set."""
        if not self._set:
            time.sleep(timeout)
        return self._set


class LocalDeployment:
    """A set of worker processes started, health-checked and stopped together."""

    def __init__(self, workers: list[WorkerProcess]) -> None:
        self.workers = workers

    def start(self, ready_timeout: float, stop: StopFlag | threading.Event) -> bool:
        """Start every worker and wait until all are healthy; False if one died or timed out."""
        for w in self.workers:
            w.start()
        deadline = time.monotonic() + ready_timeout
        pending = list(self.workers)
        while pending and time.monotonic() < deadline and not stop.is_set():
            if any(w.exited() is not None for w in self.workers):
                return False
            pending = [w for w in pending if not w.healthy()]
            if pending:
                stop.wait(POLL_S)
        return not pending

    def wait(self, stop: StopFlag | threading.Event) -> int | None:
        """Block until ``stop`` is set (None) or a worker exits (its exit code)."""
        while not stop.wait(POLL_S):
            for w in self.workers:
                if (code := w.exited()) is not None:
                    return code
        return None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every worker's process group; SIGKILL whatever is left after ``timeout``."""
        for w in self.workers:
            w.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for w in self.workers:
            if w.proc is None:
                continue
            try:
                w.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(
                    f"splitserve: {w.name} did not stop in {timeout:.0f}s; killing it",
                    file=sys.stderr,
                )
            # The group may hold children even after the leader exited.
            w.signal_group(signal.SIGKILL)
            w.proc.wait()


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

    def core_args(self, index: int) -> list[str]:
        """The thread flags of the ``index``-th worker: a vLLM worker binds to cores of its
        own (``threads_per_worker`` of them, in turn, wrapping around the machine)."""
        threads = self.threads_per_worker
        if threads is None:
            return []
        if self.engine != "vllm":
            return ["--threads", str(threads)]
        ncpu = os.cpu_count() or 1
        cores = sorted({(index * threads + k) % ncpu for k in range(threads)})
        return ["--cpus", ",".join(map(str, cores))]

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
    if topology.engine != "builtin":
        raise ValueError("--tls serves the builtin engine's workers only (not --engine vllm)")
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
        stages = _pools(host, port, model, worker_args, env, topology, tls)
    else:
        argv = worker_argv(host, port, model, worker_args)
        stages = [LocalDeployment([WorkerProcess("worker-0", argv, url, env, ca=_ca(tls))])]
    stop = StopFlag()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for stage in stages:  # workers first, then the router in front of them
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
    """The router's ``--kv-events URL=ENDPOINT`` per publishing worker, and ``--tokenizer``."""
    if topology.kv_events_tokenizer is None:
        return []
    out = ["--tokenizer", topology.kv_events_tokenizer]
    for w in workers:
        if "--kv-events-endpoint" in w.argv:
            out += ["--kv-events", f"{w.url}={w.argv[w.argv.index('--kv-events-endpoint') + 1]}"]
    return out


def _pools(
    host: str,
    port: int,
    model: str | None,
    worker_args: Sequence[str],
    env: dict[str, str],
    topology: Topology,
    tls: DeploymentTLS | None = None,
) -> list[LocalDeployment]:
    """Prefill and decode workers on free ports sharing a fresh cluster secret, and the
    router on ``port``; ``tls``: everyone serves HTTPS (``worker_args`` carry the flags)."""
    env = {**env, "SPLITSERVE_KV_SECRET": secrets.token_hex(32)}
    router_env = dict(env)
    if topology.engine == "vllm" and "SPLITSERVE_API_KEYS" in env:
        # vLLM knows no tenants: it takes one key, which only the router holds.
        env["SPLITSERVE_API_KEY"] = secrets.token_urlsafe(32)
    workers = pool_workers(host, model, worker_args, env, topology, tls)
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
    router = WorkerProcess("router", argv, url, router_env, ca=_ca(tls))
    return [LocalDeployment(workers), LocalDeployment([router])]


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
            if topology.engine == "vllm" and topology.prefill:  # NixlConnector's side channel
                args += ["--kv-port", str(free_port(host))]
            argv = worker_argv(host, wport, model, args, role=topology.worker_role(role))
            url = f"{_scheme(tls)}://{host}:{wport}"
            workers.append(WorkerProcess(f"{role}-{i}", argv, url, env, ca=_ca(tls)))
    return workers


def _scheme(tls: DeploymentTLS | None) -> str:
    return "http" if tls is None else "https"


def _ca(tls: DeploymentTLS | None) -> str | None:
    return None if tls is None else tls.ca
