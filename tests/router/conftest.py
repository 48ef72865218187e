"""Real processes on loopback: fake workers (subprocesses) and routers (uvicorn threads).

Everything started here is stopped here; every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from procs import last_test_using

from splitserve.cluster.local import die_with_parent, free_port
from splitserve.router.app import create_app
from splitserve.router.config import RouterConfig
from splitserve.router.server import RouterProtocol

FAKE_WORKER = Path(__file__).with_name("fake_worker.py")
READY_TIMEOUT_S = 30.0
# One keep-alive client for every test request: a fresh ``httpx.post`` builds a new client
# (and TLS context) each call, which costs tens of milliseconds.
HTTP = httpx.Client(timeout=30.0)


def wait_until(check, timeout_s: float = READY_TIMEOUT_S, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")


class FakeWorker:
    """A fake worker subprocess; ``mode(...)`` steers it, ``seen()`` lists its requests.

    ``tls``: (certificate file, key file) to serve HTTPS with, and ``client`` a client that
    trusts them."""

    def __init__(
        self,
        name: str,
        role: str = "both",
        tls: tuple[str, str] | None = None,
        client: httpx.Client = HTTP,
    ) -> None:
        self.name, self.role = name, role
        self.port = free_port()
        self.url = f"{'http' if tls is None else 'https'}://127.0.0.1:{self.port}"
        self.client = client
        tls_args = [] if tls is None else ["--ssl-certfile", tls[0], "--ssl-keyfile", tls[1]]
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(FAKE_WORKER),
                "--port",
                str(self.port),
                "--name",
                name,
                "--role",
                role,
                *tls_args,
            ],
            start_new_session=True,
            preexec_fn=die_with_parent,
        )

    def wait_ready(self) -> FakeWorker:
        def up() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fake worker {self.name} exited with {self.proc.returncode}")
            try:
                return self.client.get(f"{self.url}/health", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, what=f"fake worker {self.name}")
        return self

    def mode(self, **state) -> None:
        self.client.post(f"{self.url}/_mode", json=state, timeout=5.0).raise_for_status()

    def reset(self) -> None:
        self.mode(
            mode="ok",
            running=0,
            waiting=0,
            delay_s=0.0,
            greedy=False,
            die_after=2,
            set_cookie=False,
            diverge_at=None,
        )

    def seen(self) -> list[dict]:
        return self.client.get(f"{self.url}/_requests", timeout=5.0).json()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


class RouterServer:
    """A router app served by uvicorn on a thread of the test process."""

    def __init__(self, config: RouterConfig, protocol: type | str = RouterProtocol) -> None:
        self.app = create_app(config)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            http=protocol,  # as the router's command line serves it, by default
        )
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, what="router startup")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def start_workers(*names: str, role: str = "both") -> list[FakeWorker]:
    workers = [FakeWorker(n, role) for n in names]  # start all, then wait: startups overlap
    try:
        return [w.wait_ready() for w in workers]
    except Exception:
        for w in workers:
            w.kill()
        raise


@pytest.fixture(scope="session", autouse=True)
def _close_http_client() -> Iterator[None]:
    yield
    HTTP.close()


@pytest.fixture(scope="session")
def fake_workers() -> Iterator[list[FakeWorker]]:
    """Three collocated fake workers shared by the tests that do not kill them."""
    workers = start_workers("w1", "w2", "w3")
    yield workers
    for w in workers:
        w.kill()


@pytest.fixture
def workers3(fake_workers: list[FakeWorker]) -> list[FakeWorker]:
    for w in fake_workers:
        w.reset()
    return fake_workers


@pytest.fixture
def make_router() -> Iterator:
    started: list[RouterServer] = []

    def make(protocol: type | str = RouterProtocol, **options) -> RouterServer:
        options.setdefault("health_interval_s", 0.2)
        router = RouterServer(RouterConfig.from_kwargs(**options), protocol)
        started.append(router)
        return router

    yield make
    for r in started:
        r.stop()


# ---- real model workers (slow tests) ----------------------------------------------------


class RealWorker:
    """A model worker process; ``port``: the one to serve on (a restart of a killed worker
    keeps its URL), else a free one."""

    def __init__(self, port: int | None = None) -> None:
        self.port = free_port() if port is None else port
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "splitserve.cli",
                "worker",
                "--port",
                str(self.port),
                "--threads",
                "1",
                "--kv-cache-gb",
                "0.2",
                "--log-level",
                "warning",
            ],
            start_new_session=True,
            preexec_fn=die_with_parent,
        )

    def ready(self) -> bool:
        assert self.proc.poll() is None, "a worker exited during startup"
        try:
            return HTTP.get(self.url + "/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


# The model workers live from the first test that asks for them to the end of the run of
# tests that ask for them in a row (see pytest_runtest_teardown): the end-to-end modules
# share them. A worker a test killed is replaced before the next test gets the pool.
_REAL_POOL: list[RealWorker] = []


@pytest.fixture
def real_workers() -> list[RealWorker]:
    """Three live model workers; a test may kill some (the next test gets replacements)."""
    _REAL_POOL[:] = [w for w in _REAL_POOL if w.proc.poll() is None]
    fresh = [RealWorker() for _ in range(3 - len(_REAL_POOL))]
    _REAL_POOL.extend(fresh)  # before waiting: a failed start is still stopped
    for w in fresh:
        wait_until(w.ready, 300, "a model worker")
    return list(_REAL_POOL)


def restart_real_worker(killed: RealWorker) -> RealWorker:
    """A worker at ``killed``'s URL again, with nothing of its store or KV; stopped like the
    pool's."""
    worker = RealWorker(killed.port)
    _REAL_POOL.append(worker)
    wait_until(worker.ready, 300, "a restarted model worker")
    return worker


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if last_test_using("real_workers", item, nextitem):
        stop_real_workers()


def pytest_sessionfinish() -> None:
    stop_real_workers()  # after an interrupted run too


def stop_real_workers() -> None:
    for w in _REAL_POOL:
        w.kill()
    _REAL_POOL.clear()
