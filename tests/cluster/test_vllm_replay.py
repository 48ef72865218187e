"""Streams that vLLM workers resume by replaying the request (``ResumeMode.REPLAY``): a named
tool call, a JSON schema, seeded sampling, chat log-probabilities and two seeded choices, all on
one vLLM worker that is SIGKILLed while every one of them is mid-way. Each finishes on the
other worker as the same request's undisturbed stream did.

One deployment of two vLLM workers for the module, one test (a vLLM worker takes a minute or
more to start here). Skipped when ``.venv-vllm`` is absent (``make install-vllm``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import httpx
import pytest
from procs import (
    free_port,
    kill_vllm_serving,
    metric,
    serving_group,
    skip_without_vllm,
    start_launcher,
    stop_group,
    wait_serving,
)

from splitserve.cluster import group_shm

skip_without_vllm()

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]
MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
ASK = [{"role": "user", "content": "Plan a weekend trip to Paris, with a list of places."}]
PLAN = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "places": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["city", "places"],
}
TOOLS = [{"type": "function", "function": {"name": "plan_trip", "parameters": PLAN}}]
STREAMS = {  # each greedy or seeded: a replay of it reproduces its tokens
    "named tool": {
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "plan_trip"}},
        "temperature": 0,
    },
    "json schema": {
        "response_format": {"type": "json_schema", "json_schema": {"name": "plan", "schema": PLAN}},
        "temperature": 0,
    },
    "seeded": {"temperature": 0.8, "seed": 11},
    "logprobs": {"logprobs": True, "top_logprobs": 2, "temperature": 0},
    "two seeded choices": {"n": 2, "temperature": 0.8, "seed": 5},
}
MAX_TOKENS = 48
CUT = 6  # tokens each stream has had when the worker is killed (a choice of two: together)


@pytest.fixture(scope="module")
def deployment():
    port = free_port()
    argv = [sys.executable, "-m", "splitserve.cli", "serve", "--engine", "vllm"]
    argv += ["--port", str(port), "--decode", "2", "--threads-per-worker", "1"]
    argv += ["--load-factor", "2"]  # one session's five streams stay on one worker
    argv += ["--dtype", "float32", "--kv-cache-gb", "0.5", "--max-model-len", "2048"]
    argv += ["--ready-timeout", "600"]
    launcher, lines = start_launcher(argv)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(launcher, lines, url, timeout=660)
        yield url
    finally:
        stop_group(launcher, timeout=60)


class Stream(threading.Thread):
    """One streamed chat request through the router: its events as they come."""

    def __init__(self, url: str, session: str, extra: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.session = url, session
        # The client asks for token ids too (it gets each once): the test counts tokens with them.
        self.body = {"model": MODEL, "messages": ASK, "max_tokens": MAX_TOKENS, **extra}
        self.body["return_token_ids"] = True
        self.comments: list[str] = []
        self.chunks: list[dict] = []
        self.worker: str | None = None

    def run(self) -> None:
        headers = {"X-Session-Id": self.session}
        body = {**self.body, "stream": True}
        with httpx.stream(
            "POST", f"{self.url}/v1/chat/completions", json=body, headers=headers, timeout=300
        ) as r:
            assert r.status_code == 200, r.read()
            self.worker = r.headers["x-splitserve-decode-worker"]
            for line in r.iter_lines():
                if line.startswith(":"):
                    self.comments.append(line)
                elif line.startswith("data: {"):
                    self.chunks.append(json.loads(line[6:]))

    @property
    def tokens(self) -> int:
        return sum(len(ch.get("token_ids") or []) for c in self.chunks for ch in c["choices"])


def _run_all(url: str, session: str) -> dict[str, Stream]:
    streams = {name: Stream(url, session, extra) for name, extra in STREAMS.items()}
    for s in streams.values():
        s.start()
    return streams


def _reply(s: Stream) -> dict[int, dict]:
    """Per choice: its text, tool calls (name, arguments), log-probabilities and finish."""
    out: dict[int, dict] = {}
    assert not [c for c in s.chunks if "error" in c], s.chunks[-1]
    for chunk in s.chunks:
        assert chunk["id"] == s.chunks[0]["id"] and chunk["created"] == s.chunks[0]["created"]
        for ch in chunk["choices"]:
            o = out.setdefault(
                ch["index"], {"text": "", "calls": {}, "logprobs": [], "finish": [], "ids": []}
            )
            o["text"] += ch["delta"].get("content") or ""
            o["ids"] += ch.get("token_ids") or []
            for call in ch["delta"].get("tool_calls") or []:
                name, args = o["calls"].get(call["index"], ("", ""))
                f = call.get("function") or {}
                o["calls"][call["index"]] = (
                    name + (f.get("name") or ""),
                    args + (f.get("arguments") or ""),
                )
            o["logprobs"] += (ch.get("logprobs") or {}).get("content") or []
            if ch.get("finish_reason"):
                o["finish"].append(ch["finish_reason"])
    return out


def _check_same(got: dict[int, dict], want: dict[int, dict], name: str) -> None:
    assert got.keys() == want.keys(), name
    for i, (g, w) in enumerate(zip(got.values(), want.values(), strict=True)):
        where = f"{name}, choice {i}"
        assert (g["text"], g["calls"], g["finish"]) == (w["text"], w["calls"], w["finish"]), where
        assert g["ids"] == w["ids"], where
        assert [t["token"] for t in g["logprobs"]] == [t["token"] for t in w["logprobs"]], where
        for gt, wt in zip(g["logprobs"], w["logprobs"], strict=True):
            assert gt["logprob"] == pytest.approx(wt["logprob"], abs=1e-3), where
            assert [t["token"] for t in gt["top_logprobs"]] == [
                t["token"] for t in wt["top_logprobs"]
            ]
            got_top = [t["logprob"] for t in gt["top_logprobs"]]
            assert got_top == pytest.approx([t["logprob"] for t in wt["top_logprobs"]], abs=1e-3)


def test_a_killed_vllm_worker_mid_stream_replays_tools_grammars_seeds_logprobs_and_choices(
    deployment,
):
    url = deployment
    undisturbed = _run_all(url, "undisturbed")
    for s in undisturbed.values():
        s.join(timeout=300)
    lengths = {name: s.tokens for name, s in undisturbed.items()}
    assert all(n >= 2 * CUT for n in lengths.values()), lengths  # long enough to cut mid-way
    killed = _run_all(url, "killed")
    deadline = time.monotonic() + 300
    while not all(s.tokens >= CUT for s in killed.values()):
        alive = {name: (s.is_alive(), s.tokens) for name, s in killed.items()}
        assert time.monotonic() < deadline and all(a for a, _ in alive.values()), alive
        time.sleep(0.005)
    [worker] = {s.worker for s in killed.values()}
    shm = group_shm.mapped(serving_group(worker))
    assert shm, "vLLM maps no multiprocessing shared memory"
    kill_vllm_serving(worker)
    cut = {name: s.tokens for name, s in killed.items()}
    for s in killed.values():
        s.join(timeout=300)
    for name, s in killed.items():
        assert cut[name] < s.tokens, f"{name} had ended before the kill"
        assert any(c.startswith(": splitserve migrated to") and "(replay)" in c for c in s.comments)
        _check_same(_reply(s), _reply(undisturbed[name]), name)
    assert metric(url, "splitserve:router_migrations_total") == len(STREAMS)
    assert metric(url, "splitserve:router_replay_divergences_total") == 0
    # What the killed vLLM could not unlink, its supervisor removed.
    deadline = time.monotonic() + 60
    while any(os.path.exists(p) for p in shm):
        assert time.monotonic() < deadline, sorted(p for p in shm if os.path.exists(p))
        time.sleep(0.2)
