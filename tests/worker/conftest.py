"""A real worker process on a free loopback port, shared by the tests of this package."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import pytest

API_KEY = "sk-worker-test"
# Small enough that "prompt too long" needs only a short prompt; big enough for every test.
MAX_MODEL_LEN = 512


@dataclass(frozen=True)
class Worker:
    url: str
    api_key: str
    model: str
    proc: subprocess.Popen

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def load(self) -> dict:
        return httpx.get(f"{self.url}/load", headers=self.headers, timeout=5).json()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the process exited with code {proc.returncode} before serving")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} was not healthy after {timeout:.0f}s")


def stop_group(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """SIGTERM the process's group, then SIGKILL it if it lingers (it runs in its own session)."""
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


@pytest.fixture(scope="session")
def worker() -> Worker:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "splitserve.cli",
        "worker",
        "--role",
        "both",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "SPLITSERVE_API_KEY": API_KEY}
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
        yield Worker(url, API_KEY, models.json()["data"][0]["id"], proc)
    finally:
        stop_group(proc)


@pytest.fixture(scope="session")
def offline_llm():
    """The offline engine on the same model, for comparing replies."""
    from splitserve import LLM

    return LLM(max_model_len=MAX_MODEL_LEN)
