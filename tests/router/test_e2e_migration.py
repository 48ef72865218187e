"""End to end with real model workers: a decode worker killed mid-stream fails no client.

Slow (three model processes on loopback): ``pytest -m slow tests/router``.
"""

from __future__ import annotations

import json
import threading

import pytest

from splitserve.router.proxy import DECODE_HEADER

from .conftest import HTTP, RealWorker
from .test_proxy import metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SESSIONS = [f"mig-{i}" for i in range(6)]
MAX_TOKENS = 80  # long enough that a kill after a few chunks lands mid-stream
KILL_AFTER_CHUNKS = 4
MIGRATED = ": splitserve migrated to"


class Stream:
    """One streamed chat turn, read on a thread; ``progress`` fires after a few chunks."""

    def __init__(self, router_url: str, session: str, max_tokens: int = MAX_TOKENS) -> None:
        self.session, self.max_tokens = session, max_tokens
        self.url = router_url
        self.worker = ""
        self.lines: list[str] = []
        self.error: BaseException | None = None
        self.progress = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {
            "messages": [{"role": "user", "content": f"Write a long story about {self.session}."}],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,  # every stream runs its full length, so a kill lands mid-stream
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        try:
            headers = {"X-Session-Id": self.session}
            with HTTP.stream(
                "POST", self.url + "/v1/chat/completions", json=body, headers=headers, timeout=300
            ) as r:
                assert r.status_code == 200, r.read()
                self.worker = r.headers[DECODE_HEADER]
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
                    if len(self.lines) >= KILL_AFTER_CHUNKS:
                        self.progress.set()
        except BaseException as e:  # reported by ``result``
            self.error = e
        self.progress.set()

    def result(self) -> tuple[str, int, int]:
        """(text, prompt and completion tokens); asserts a complete stream with no error."""
        self.thread.join(timeout=600)
        assert self.error is None, repr(self.error)
        assert self.lines[-1] == "data: [DONE]"
        chunks = [json.loads(x[6:]) for x in self.lines if x.startswith("data: {")]
        assert all("error" not in c for c in chunks), chunks
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        usage = chunks[-1]["usage"]  # cached tokens differ between runs: not compared
        text = "".join(d.get("content", "") for d in deltas)
        return text, usage["prompt_tokens"], usage["completion_tokens"]

    @property
    def migrated(self) -> bool:
        return any(x.startswith(MIGRATED) for x in self.lines)


def run_streams(router_url: str, workers: list[RealWorker] | None = None):
    """Stream every session at once; with ``workers``, SIGKILL the one serving the most
    streams once every stream has its first chunks. Returns (streams, victim or None)."""
    streams = {s: Stream(router_url, s) for s in SESSIONS}
    for st in streams.values():
        st.thread.start()
    victim = None
    if workers is not None:
        for st in streams.values():
            st.progress.wait(timeout=300)
        victim = max(workers, key=lambda w: sum(st.worker == w.url for st in streams.values()))
        victim.kill()
    for st in streams.values():
        st.thread.join(timeout=600)
    return streams, victim


def homes(router_url: str) -> dict[str, str]:
    """Where each session's short turn lands when turns come one at a time (no load skew)."""
    out = {}
    for s in SESSIONS:
        st = Stream(router_url, s, max_tokens=2)
        st.thread.start()
        st.thread.join(timeout=600)
        st.result()
        out[s] = st.worker
    return out


def test_killed_worker_mid_stream_fails_no_request_and_greedy_output_is_unchanged(
    real_workers, make_router
):
    workers = real_workers
    router = make_router(workers=[w.url for w in workers])
    clean, _ = run_streams(router.url)
    reference = {s: st.result() for s, st in clean.items()}
    before = homes(router.url)

    disturbed, victim = run_streams(router.url, workers)

    # Concurrent arrivals may place a session off its home (bounded loads), so the victim's
    # streams are those it was serving in this run.
    on_victim = {s for s, st in disturbed.items() if st.worker == victim.url}
    assert on_victim
    for s, st in disturbed.items():
        assert st.result() == reference[s], s  # zero failures; same text and token counts
    assert {s for s, st in disturbed.items() if st.migrated} == on_victim
    assert metric(router, "splitserve:router_migrations_total") == len(on_victim)
    # Later turns: the sessions at home on the victim have moved, and only they have.
    after = homes(router.url)
    assert {s for s in SESSIONS if after[s] != before[s]} == {
        s for s in SESSIONS if before[s] == victim.url
    }
