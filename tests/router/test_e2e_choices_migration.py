"""End to end with real model workers: streams of ``n > 1`` choices survive a killed worker.

Each choice resumes from its own output (``resume.choices``, ``router/migration.py``); a
choice that had ended is not run again. Choices' chunks interleave as the engine steps them,
so streams are compared choice by choice: each choice's chunks, and the usage, equal an
undisturbed run's but for ids and timestamps (and log-probabilities within the float32
engine's rounding across batch sizes, ``LOGPROB_TOL``).

Slow (three model processes on loopback): ``pytest -m slow tests/router``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from .test_e2e_agent_migration import (
    CHAT,
    COMPLETIONS,
    FORECAST_TOOL,
    KILL_AFTER_TOKENS,
    LONG,
    MIGRATED,
    STORY,
    chunks,
    comparable,
    request,
    run_all,
    same,
    stream_lines,
)
from .test_proxy import metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "greedy": (CHAT, {"messages": STORY, "temperature": 0, "n": 2, **LONG}),
    "seeded": (
        CHAT,
        {"messages": STORY, "temperature": 0.9, "top_p": 0.95, "seed": 11, "n": 3, **LONG},
    ),
    "completion_logprobs": (
        COMPLETIONS,
        {"prompt": "Once upon a time,", "temperature": 0, "n": 2, "logprobs": 2, **LONG},
    ),
    "tool_named_seeded": (  # each choice a call of the named tool, its arguments by schema
        CHAT,
        {
            "messages": [{"role": "user", "content": "What will the weather be in Lisbon?"}],
            "tools": [FORECAST_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_forecast"}},
            "temperature": 0.8,
            "seed": 7,
            "n": 2,
        },
    ),
}


def by_choice(lines: list[str]) -> dict[Any, list[str]]:
    """The stream's comparable data lines, by choice index ("usage", "done" for the rest)."""
    out: dict[Any, list[str]] = {}
    for line in comparable(lines):
        if line == "data: [DONE]":
            key: Any = "done"
        else:
            choices = json.loads(line[6:])["choices"]
            key = choices[0]["index"] if choices else "usage"
        out.setdefault(key, []).append(line)
    return out


def without_prompt_ids(line: str) -> str:
    """A data line without the prompt's ids (the first chunk of a stream with ids has them;
    the router strips them from a resumed leg's)."""
    chunk = json.loads(line[6:])
    if chunk.pop("prompt_token_ids", None) is None:
        return line
    return "data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))


def outputs(lines: list[str]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for c in chunks(lines):
        for choice in c["choices"]:
            out.setdefault(choice["index"], []).extend(choice.get("token_ids", []))
    return out


# A tool call streams whole once its arguments are complete (no chunk per token): the kill
# test below covers it.
@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("tool")])
def test_resumed_choices_stream_what_the_undisturbed_ones_sent_after_their_output(
    real_workers, case
):
    url = real_workers[0].url
    path, body = request(case, ids=True, cases=CASES)
    whole = stream_lines(url, path, body)
    prompt = chunks(whole)[0]["prompt_token_ids"]
    done = outputs(whole)
    n = body["n"]
    # Each choice resumed after a different number of its tokens; the last had ended.
    cut = {i: 5 + 7 * i for i in range(n - 1)}
    resume = {
        "prompt_token_ids": prompt,
        "choices": [
            {"output_token_ids": done[i][: cut[i]], "finish_reason": None}
            if i in cut
            else {"output_token_ids": done[i], "finish_reason": "length"}
            for i in range(n)
        ],
    }
    resumed = by_choice(stream_lines(url, path, {**body, "resume": resume}))
    expected = by_choice(whole)
    lead = 1 if path == CHAT else 0  # the role chunk
    for i, k in cut.items():
        assert same([without_prompt_ids(line) for line in resumed[i]], expected[i][lead + k :]), i
    assert n - 1 not in resumed
    assert resumed["usage"] == expected["usage"] and resumed["done"] == expected["done"]


def test_streams_of_several_choices_survive_a_killed_worker(real_workers, make_router):
    router = make_router(workers=[w.url for w in real_workers], load_floor=64)
    clean = run_all(router.url, cases=CASES)
    disturbed = run_all(router.url, real_workers, cases=CASES)

    for key, s in disturbed.items():
        n = s.body["n"]
        got, want = by_choice(s.lines), by_choice(clean[key].lines)
        assert got.keys() == want.keys() and all(same(got[k], want[k]) for k in want), key
        if key[0].startswith("tool"):  # every choice called the tool
            finishes = [
                json.loads(want[i][-1][6:])["choices"][0]["finish_reason"] for i in range(n)
            ]
            assert finishes == ["tool_calls"] * n, key
        else:
            assert all(len(want[i]) >= 40 for i in range(n)), key  # every choice ran to length
        moved = [i for i, line in enumerate(s.lines) if line.startswith(MIGRATED)]
        assert len(moved) == 1, key
        if s.ids:  # every choice was mid-way when its worker died
            before = outputs(s.lines[: moved[0]])
            assert all(len(before[i]) >= 1 for i in range(n)), key
            assert sum(map(len, before.values())) >= KILL_AFTER_TOKENS * n, key
    assert metric(router, "splitserve:router_migrations_total") == len(disturbed)
