"""``splitserve worker --step-log-dir``: every engine step's shape and model time, as
``splitserve sim calibrate --from-steps`` reads them."""

from __future__ import annotations

import json
import secrets

import httpx


def _lines(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_a_worker_logs_its_engine_and_each_step_of_a_request_with_its_shape(worker):
    head = _lines(worker.step_log)[0]["engine"]
    assert head["role"] == "both" and head["url"] == worker.url and head["threads"] >= 1
    assert head["fused_decode_max_seqs"] >= 0
    before = len(_lines(worker.step_log))
    # Words no other test sends: nothing of the prompt is in the prefix cache.
    text = " ".join(secrets.token_hex(3) for _ in range(12))
    r = httpx.post(
        f"{worker.url}/v1/completions",
        headers=worker.headers,
        json={"model": worker.model, "prompt": text, "max_tokens": 4, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    n, k = usage["prompt_tokens"], usage["completion_tokens"]
    steps = _lines(worker.step_log)[before:]
    # The prefill (one step: the prompt is far below the step's token budget), then a decode
    # step for every token after the first, each reading one more position.
    assert [(s["tokens"], s["seqs"], s["sampled"], s["kv_read"]) for s in steps] == [
        (n, 1, 1, n),
        *((1, 1, 1, n + i) for i in range(1, k)),
    ]
    assert steps[0]["attended"] == n * (n + 1) / 2
    assert [s["attended"] for s in steps[1:]] == [n + i for i in range(1, k)]
    assert all(s["seconds"] > 0 and s["cpu_seconds"] > 0 for s in steps)
    assert [s["t"] for s in steps] == sorted(s["t"] for s in steps)
