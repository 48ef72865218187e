"""A real worker binds its port as it starts: while its model loads, connections are refused
and nothing else can take the port; a port already taken ends it at once, with one line saying
so and uvicorn's startup-failure exit code (what a launcher retries on another port)."""

from __future__ import annotations

import errno
import socket
import subprocess
import sys
import time

import httpx
from procs import start_worker, stop_group, wait_healthy

from splitserve.common.listen import STARTUP_FAILED


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError as e:
            assert e.errno == errno.EADDRINUSE
            return False


def test_the_port_is_held_from_startup_and_served_once_the_model_is_loaded(tmp_path):
    log = tmp_path / "worker.log"
    with log.open("w") as stderr:
        url, proc = start_worker(["--log-level", "info"], stderr=stderr)
    port = int(url.rsplit(":", 1)[1])
    try:
        deadline = time.monotonic() + 60
        while _bindable(port):  # until the worker has bound it
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        refused = False
        try:
            httpx.get(f"{url}/health", timeout=5)
        except httpx.ConnectError:
            refused = True  # still loading its model: bound, not listening
        wait_healthy(url, proc)
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 200
        assert not _bindable(port)
        assert refused, "the worker was serving before the test saw it bound"
        assert f"serving on {url}" in log.read_text()
    finally:
        stop_group(proc)


def test_a_taken_port_ends_the_worker_with_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "splitserve.cli", "worker", "--port", str(port)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == STARTUP_FAILED
    assert f"splitserve worker: cannot bind 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr
