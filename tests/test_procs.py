"""The test helpers' restart of a process whose startup failed (tests/procs.py), on real
processes: one that exits as uvicorn does when its port is taken, then a real HTTP server."""

from __future__ import annotations

import subprocess
import sys

import pytest
from procs import STARTUP_FAILED, free_port, stop_group, wait_healthy_or_restart

SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def exiting(code: int) -> tuple[str, subprocess.Popen]:
    proc = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
    return f"http://127.0.0.1:{free_port()}", proc


def server() -> tuple[str, subprocess.Popen]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], start_new_session=True)
    return f"http://127.0.0.1:{port}", proc


def test_a_failed_startup_is_started_again_and_the_healthy_one_returned():
    started = []

    def start():
        started.append(server())
        return started[-1]

    url, proc = wait_healthy_or_restart(*exiting(STARTUP_FAILED), start)
    try:
        assert len(started) == 1 and (url, proc) == started[0] and proc.poll() is None
    finally:
        stop_group(proc)


def test_any_other_exit_is_raised_without_a_restart():
    started = []
    with pytest.raises(RuntimeError, match="exited with code 1"):
        wait_healthy_or_restart(*exiting(1), lambda: started.append(1))
    assert not started
