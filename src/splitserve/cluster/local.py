"""Start a deployment as local processes and stop every one of them on SIGINT/SIGTERM.

Each worker runs in its own session (so its own process group): a terminal's Ctrl-C reaches
only the launcher, which then stops each group as a whole, so nothing a worker started can
outlive it. On Linux a worker also gets SIGTERM if the launcher dies without cleaning up.

``cluster.serve`` decides which processes a deployment has.
"""

from __future__ import annotations

import os
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
from urllib.parse import urlsplit, urlunsplit

import httpx

from splitserve.common.listen import STARTUP_FAILED
from splitserve.common.tls import client_context

if TYPE_CHECKING:
    pass

POLL_S = 0.2
MOVES = 3  # new ports a movable worker may try after its first (LocalDeployment.start)


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
    movable: bool = False  # its --port was picked by the launcher, which may pick another

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.argv,
            env={**os.environ, **self.env},
            start_new_session=True,
            preexec_fn=die_with_parent,
        )

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def move(self) -> int:
        """Point ``--port`` and the URL at another free port of the same host; returns it."""
        parts = urlsplit(self.url)
        host = parts.hostname or "127.0.0.1"
        port = free_port(host)
        self.argv[self.argv.index("--port") + 1] = str(port)
        netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.url = urlunsplit(parts._replace(netloc=netloc))
        return port

    def healthy(self) -> bool:
        return healthy(self.url, self.health_path, self.ca)

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)  # its pgid is its pid: start_new_session
        except ProcessLookupError:
            pass


def healthy(url: str, path: str = "/health", ca: str | ssl.SSLContext | None = None) -> bool:
    """Whether the server at ``url`` answers ``path`` with 200; ``ca``: what an https://
    server's certificate is verified against, a CA file or a client context (default:
    httpx's usual trust)."""
    verify: ssl.SSLContext | bool = True
    if ca is not None:
        verify = _ca_context(ca) if isinstance(ca, str) else ca
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


def stop_group(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """SIGTERM the process group of ``proc`` (started with ``start_new_session``), then SIGKILL
    it if ``proc`` lingers past ``timeout`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout)
            return
        except subprocess.TimeoutExpired:
            continue


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
        """Start every worker and wait until all are healthy; False if one died or timed out.
        A movable worker that found its port taken (another process got it between the
        launcher's pick and the worker's bind) is started again on another, up to
        ``MOVES`` times."""
        for w in self.workers:
            w.start()
        moves = [MOVES] * len(self.workers)  # left, per worker
        deadline = time.monotonic() + ready_timeout
        pending = list(self.workers)
        while pending and time.monotonic() < deadline and not stop.is_set():
            for i, w in enumerate(self.workers):
                code = w.exited()
                if code is None:
                    continue
                if code != STARTUP_FAILED or not w.movable or moves[i] == 0:
                    return False
                moves[i] -= 1
                print(
                    f"splitserve: {w.name} did not start on {w.url} (its port taken, or its "
                    f"server failed); starting it again on port {w.move()}",
                    file=sys.stderr,
                )
                w.start()
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
