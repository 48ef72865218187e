"""A real worker process on a free loopback port, shared by the tests of this package."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import httpx
import pytest
from procs import die_with_parent, free_port, stop_group, wait_healthy

API_KEY = "sk-worker-test"
# Small enough that "prompt too long" needs only a short prompt; big enough for every test.
MAX_MODEL_LEN = 512


@dataclass(frozen=True)
class Worker:
    url: str
    api_key: str
    model: str
    proc: subprocess.Popen
    step_log: str  # the engine's step log (``--step-log-dir``)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def load(self) -> dict:
        return httpx.get(f"{self.url}/load", headers=self.headers, timeout=5).json()


@pytest.fixture(scope="session")
def worker(tmp_path_factory) -> Worker:
    port = free_port()
    step_logs = tmp_path_factory.mktemp("step-logs")
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
        "--step-log-dir",
        str(step_logs),
    ]
    env = {**os.environ, "SPLITSERVE_API_KEY": API_KEY}
    proc = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=die_with_parent)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
        model = models.json()["data"][0]["id"]
        yield Worker(url, API_KEY, model, proc, str(step_logs / f"both-{port}.jsonl"))
    finally:
        stop_group(proc)


@pytest.fixture(scope="session")
def offline_llm():
    """The offline engine on the same model, for comparing replies."""
    from splitserve import LLM

    return LLM(max_model_len=MAX_MODEL_LEN)
