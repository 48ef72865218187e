"""Helpers for tests that run real splitserve processes on loopback."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

from splitserve.cluster.local import die_with_parent, free_port, stop_group
from splitserve.common.listen import STARTUP_FAILED
from splitserve.common.tenants import DEFAULT_TENANT, TENANT_HEADER, sign

__all__ = [
    "as_router",
    "copy_checkout",
    "env_for_checkout",
    "die_with_parent",
    "free_port",
    "last_test_using",
    "metric",
    "skip_without_vllm",
    "start_launcher",
    "start_worker",
    "stop_group",
    "wait_healthy",
    "wait_healthy_or_restart",
]


def start_worker(
    args: list[str],
    secret: str | None = None,
    threads: int = 1,
    env: dict | None = None,
    tls: tuple[str, str] | None = None,
    stderr=None,
) -> tuple[str, subprocess.Popen]:
    """Start ``splitserve worker`` on a free port in its own session; returns (url, proc).
    ``tls``: (certificate file, key file) to serve HTTPS with; ``stderr``: where its log goes
    (``subprocess.Popen``'s argument; this process's stderr by default)."""
    port = free_port()
    argv = [sys.executable, "-m", "splitserve.cli", "worker", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--threads", str(threads), "--log-level", "warning", *args]
    if tls is not None:
        argv += ["--ssl-certfile", tls[0], "--ssl-keyfile", tls[1]]
    full_env = {**os.environ, **(env or {})}
    if secret is not None:
        full_env["SPLITSERVE_KV_SECRET"] = secret
    proc = subprocess.Popen(
        argv, env=full_env, stderr=stderr, start_new_session=True, preexec_fn=die_with_parent
    )
    return f"{'http' if tls is None else 'https'}://127.0.0.1:{port}", proc


def last_test_using(fixture: str, item, nextitem) -> bool:
    """Whether pytest's ``item`` uses ``fixture`` and the test after it (``nextitem``, None at
    the end) does not: a module-spanning fixture can stop its processes there."""
    return fixture in item.fixturenames and (
        nextitem is None or fixture not in nextitem.fixturenames
    )


def wait_healthy(
    url: str, proc: subprocess.Popen, timeout: float = 240.0, verify: ssl.SSLContext | bool = True
) -> None:
    """Until ``url/health`` answers 200 (``verify``: what an https:// server is verified by)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1, verify=verify).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} was not healthy after {timeout:.0f}s")


def wait_healthy_or_restart(
    url: str, proc: subprocess.Popen, start, tries: int = 3
) -> tuple[str, subprocess.Popen]:
    """``wait_healthy``; where the process exited as a failed startup, ``start()`` it again
    (another free port), up to ``tries`` starts in all. Returns the healthy (url, proc)."""
    for attempt in range(tries):
        try:
            wait_healthy(url, proc)
            return url, proc
        except RuntimeError:
            if proc.poll() != STARTUP_FAILED or attempt == tries - 1:
                raise
            url, proc = start()
    raise AssertionError("unreachable")


def metric(
    url: str, name: str, headers: dict | None = None, verify: ssl.SSLContext | bool = True
) -> float:
    """A sample from ``/metrics``: ``name`` alone sums every label set, ``name{k="v"}`` is exact."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10, verify=verify).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        sample, _, value = line.rpartition(" ")
        if sample == name or ("{" not in name and sample.split("{")[0] == name):
            total += float(value)
    return total


def as_router(
    url: str, path: str, body: dict, secret: str, tenant: str = DEFAULT_TENANT, **kw
) -> httpx.Response:
    """POST ``body`` to a worker signed as the router signs it (what lets a body carry
    ``kv_peer`` or ``kv_transfer_params``)."""
    content = json.dumps(body).encode()
    headers = {
        "content-type": "application/json",
        TENANT_HEADER: sign(secret.encode(), "POST", path, tenant, content),
        **kw.pop("headers", {}),
    }
    return httpx.post(f"{url}{path}", content=content, headers=headers, **kw)


def copy_checkout(dest: Path) -> Path:
    """The project's files (``src/``, ``pyproject.toml``, ``README.md``; no virtualenv, no
    caches) copied to ``dest/splitserve``; returns that directory."""
    root = Path(__file__).resolve().parents[1]
    copy = dest / "splitserve"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".*")
    shutil.copytree(root / "src", copy / "src", ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, copy / name)
    return copy


def env_for_checkout(copy: Path) -> dict[str, str]:
    """This process's environment with ``copy``'s ``src`` first on the path and no
    ``SPLITSERVE_TRACES_DIR``."""
    env = {k: v for k, v in os.environ.items() if k != "SPLITSERVE_TRACES_DIR"}
    return {**env, "PYTHONPATH": str(copy / "src")}


def skip_without_vllm() -> None:
    """Skip the calling test module where no vLLM is installed (``make install-vllm``)."""
    import pytest

    from splitserve.cluster.vllm_worker import find_vllm_python

    try:
        find_vllm_python()
    except ValueError as e:
        pytest.skip(f"no vLLM here ({e})", allow_module_level=True)


def start_launcher(
    argv: list[str],
    env: dict[str, str] | None = None,
    log: list[str] | None = None,
    stderr: bool = False,
) -> tuple[subprocess.Popen, queue.Queue]:
    """``argv`` (a ``splitserve serve`` command line) in a session of its own, with a thread
    putting each line of its stdout (and its stderr with ``stderr``) into the returned queue
    (and ``log``). The caller stops it with ``stop_group``."""
    launcher = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if stderr else None,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=read_lines, args=(launcher.stdout, lines, log), daemon=True).start()
    return launcher, lines


def read_lines(stream, out: queue.Queue, log: list[str] | None = None) -> None:
    """Every line of ``stream`` into ``out`` (and ``log``), until it ends: a reader thread's
    loop over a launcher's stdout."""
    for line in stream:
        if log is not None:
            log.append(line)
        out.put(line)


def wait_serving(launcher: subprocess.Popen, lines: queue.Queue, url: str, timeout: float) -> None:
    """Until ``splitserve serve`` prints that it serves ``url``/v1 (its lines in ``lines``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert launcher.poll() is None, f"serve exited with code {launcher.returncode}"
        try:
            if f"{url}/v1" in lines.get(timeout=1.0):
                return
        except queue.Empty:
            pass
    raise TimeoutError(f"serve was not ready after {timeout:.0f}s")


def serving_group(worker_url: str) -> int:
    """The process group of the server listening on ``worker_url``'s port."""
    port = int(worker_url.rsplit(":", 1)[1])
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return os.getpgid(conn.pid)
    raise AssertionError(f"nothing listens on {worker_url}")


def kill_vllm_serving(worker_url: str) -> int:
    """SIGKILL the process group of the vLLM server listening on ``worker_url``'s port."""
    pgid = serving_group(worker_url)
    os.killpg(pgid, signal.SIGKILL)
    return pgid
