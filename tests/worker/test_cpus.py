"""``splitserve worker --cpus``: a builtin worker and every thread it starts stay on its cores."""

from __future__ import annotations

import os

import httpx
from procs import start_worker, stop_group, wait_healthy


def test_every_thread_of_a_bound_worker_runs_on_its_core():
    core = max(os.sched_getaffinity(0))
    url, proc = start_worker(["--cpus", str(core), "--host-kv-gb", "0.05"])
    try:
        wait_healthy(url, proc)
        body = {"prompt": "The engine's threads", "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        tids = os.listdir(f"/proc/{proc.pid}/task")
        assert len(tids) > 2  # the engine thread and the rest started after the binding
        assert {tid: os.sched_getaffinity(int(tid)) for tid in tids} == {
            tid: {core} for tid in tids
        }
    finally:
        stop_group(proc)
