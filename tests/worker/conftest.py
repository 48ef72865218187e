"""A real worker process on a free loopback port, shared by the tests of this package."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

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


# The shared worker and offline engine live from the first test that uses them to the last
# test of this directory (see pytest_runtest_teardown), not to the end of the session:
# together they hold ~3 GB that later directories' workers need. The fixtures hand out
# stand-ins that start them on first use (again, after a release).
_HELD: dict[str, object] = {}
_HERE = Path(__file__).resolve().parent


class _Started:
    """Stands in for ``_HELD[key]``, made by ``start()`` when first needed."""

    def __init__(self, key: str, start) -> None:
        self._key, self._start = key, start

    def __getattr__(self, name: str):
        if self._key not in _HELD:
            _HELD[self._key] = self._start()
        return getattr(_HELD[self._key], name)


@pytest.fixture(scope="session")
def worker(tmp_path_factory) -> Worker:
    return _Started("worker", lambda: _start_worker(tmp_path_factory))


@pytest.fixture(scope="session")
def offline_llm():
    """The offline engine on the same model, for comparing replies."""

    def start():
        from splitserve import LLM

        return LLM(max_model_len=MAX_MODEL_LEN)

    return _Started("llm", start)


def _start_worker(tmp_path_factory) -> Worker:
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
    except BaseException:
        stop_group(proc)
        raise
    return Worker(url, API_KEY, model, proc, str(step_logs / f"both-{port}.jsonl"))


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if nextitem is None or not nextitem.path.resolve().is_relative_to(_HERE):
        release()


def pytest_sessionfinish() -> None:
    release()  # after an interrupted run too


def release() -> None:
    """Stop the shared worker and drop the offline engine (the next test to ask starts anew)."""
    held = _HELD.pop("worker", None)
    if held is not None:
        stop_group(held.proc)
    if _HELD.pop("llm", None) is not None:
        gc.collect()
