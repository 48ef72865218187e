"""End to end with real model workers (``splitserve worker``): stickiness and cache reuse.

Slow (three model processes on loopback): ``pytest -m slow tests/router``.
"""

from __future__ import annotations

import pytest

from splitserve.router.proxy import DECODE_HEADER

from .conftest import HTTP

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SYSTEM = (
    "You are a careful coding agent working in a large repository. You read files, run "
    "tests, and propose small patches. Always explain the failing test first, then the "
    "fix, then how you verified it. Keep every answer short and precise. "
) * 2


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


def test_20_sessions_of_5_turns_stay_home_and_reuse_their_cache(real_workers, make_router):
    router = make_router(workers=[w.url for w in real_workers])
    on_first, turns, reuse = 0, 0, []
    for s in range(20):
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
