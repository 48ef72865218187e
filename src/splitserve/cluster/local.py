"""Start a deployment as local processes and stop every one of them on SIGINT/SIGTERM.

Each worker runs in its own session (so its own process group): a terminal's Ctrl-C reaches
only the launcher, which then stops each group as a whole, so nothing a worker started can
outlive it. On Linux a worker also gets SIGTERM if the launcher dies without cleaning up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

POLL_S = 0.2


@dataclass(slots=True)
class WorkerProcess:
    """One worker subprocess and the URL it serves on."""

    name: str
    argv: list[str]
    url: str
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.argv,
            env={**os.environ, **self.env},
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)  # its pgid is its pid: start_new_session
        except ProcessLookupError:
            pass


def _die_with_parent() -> None:
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def worker_argv(host: str, port: int, model: str | None, extra: Sequence[str] = ()) -> list[str]:
    """The command line of one collocated worker."""
    argv = [
        sys.executable,
        "-m",
        "splitserve.cli",
        "worker",
        "--role",
        "both",
        "--host",
        host,
        "--port",
        str(port),
    ]
    if model is not None:
        argv += ["--model", model]
    return argv + list(extra)


class LocalDeployment:
    """A set of worker processes started, health-checked and stopped together."""

    def __init__(self, workers: list[WorkerProcess]) -> None:
        self.workers = workers

    def start(self, ready_timeout: float, stop: threading.Event) -> bool:
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

    def wait(self, stop: threading.Event) -> int | None:
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


def serve(
    host: str = "127.0.0.1",
    port: int = 8000,
    model: str | None = None,
    worker_args: Sequence[str] = (),
    api_key: str | None = None,
    ready_timeout: float = 600.0,
) -> int:
    """Run one collocated worker until SIGINT/SIGTERM; return the process exit code."""
    env = {"SPLITSERVE_API_KEY": api_key} if api_key else {}
    url = f"http://{host}:{port}"
    worker = WorkerProcess("worker-0", worker_argv(host, port, model, worker_args), url, env)
    deployment = LocalDeployment([worker])
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if not deployment.start(ready_timeout, stop):
            if stop.is_set():
                return 0
            print(f"splitserve: the worker did not become healthy at {url}", file=sys.stderr)
            return 1
        print(f"splitserve: serving the OpenAI API at {url}/v1 (Ctrl-C to stop)", flush=True)
        code = deployment.wait(stop)
        if code is not None:
            print(f"splitserve: the worker exited with code {code}", file=sys.stderr)
            return 1
        return 0
    finally:
        deployment.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
