"""End to end with real model workers (``splitserve worker``): stickiness and cache reuse.

Slow (three model processes on loopback): ``pytest -m slow tests/router``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from splitserve.router.proxy import DECODE_HEADER

from .conftest import HTTP, free_port, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SYSTEM = (
    "You are a careful coding agent working in a large repository. You read files, run "
    "tests, and propose small patches. Always explain the failing test first, then the "
    "fix, then how you verified it. Keep every answer short and precise. "
) * 2


class RealWorker:
    def __init__(self) -> None:
        self.port = free_port()
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


@pytest.fixture(scope="module")
def real_workers() -> Iterator[list[RealWorker]]:
    workers = [RealWorker() for _ in range(3)]
    try:
        for w in workers:
            wait_until(w.ready, 300, "a model worker")
        yield workers
    finally:
        for w in workers:
            w.kill()


def turn(router, messages: list[dict], key: str | None) -> tuple[str, str, dict]:
    headers = {"X-Session-Id": key} if key else {}
    r = HTTP.post(
        router.url + "/v1/chat/completions",
        headers=headers,
        timeout=120.0,
        json={"messages": messages, "max_tokens": 4, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    return r.headers[DECODE_HEADER], body["choices"][0]["message"]["content"], body["usage"]


def test_50_sessions_of_5_turns_stay_home_and_reuse_their_cache(real_workers, make_router):
    router = make_router(workers=[w.url for w in real_workers])
    on_first, turns, reuse = 0, 0, []
    for s in range(50):
        # Half the sessions name themselves; the other half rely on the conversation hash.
        key = f"session-{s}" if s % 2 == 0 else None
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Task {s}: the test test_{s} fails."},
        ]
        first, previous_prompt = None, 0
        for t in range(5):
            worker, reply, usage = turn(router, messages, key)
            first = first or worker
            on_first += worker == first
            turns += 1
            if t > 0:
                reuse.append(usage["prompt_tokens_details"]["cached_tokens"] / previous_prompt)
            previous_prompt = usage["prompt_tokens"]
            messages += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": f"Observation {t}: still failing."},
            ]
    assert on_first / turns >= 0.99
    assert min(reuse) >= 0.9, sorted(reuse)[:5]


def test_killed_worker_fails_no_request_and_moves_only_its_sessions(real_workers, make_router):
    router = make_router(workers=[w.url for w in real_workers])
    keys = [f"kill-{i}" for i in range(9)]
    convo = {k: [{"role": "user", "content": f"Count to ten, {k}."}] for k in keys}
    before = {k: turn(router, convo[k], k) for k in keys}
    victim = real_workers[2]
    victim.kill()
    after = {k: turn(router, convo[k], k) for k in keys}  # every one answers
    assert {k for k in keys if before[k][0] != after[k][0]} == {
        k for k in keys if before[k][0] == victim.url
    }
    assert {k: after[k][1] for k in keys} == {k: before[k][1] for k in keys}  # greedy: same
