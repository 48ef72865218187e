"""Step plans for the model runner tests: prompts, chunks, and runs of decode steps."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.plan import ScheduledChunk, StepPlan

GREEDY = SamplingParams(temperature=0)


def chunk(rid: str, tokens: list[int], start: int, table: list[int], n_out: int = 0):
    return ScheduledChunk(rid, tokens, start, table, True, GREEDY, n_out)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def decode_steps(runners, steps: int = 10) -> Iterator[StepPlan]:
    """Three sequences prefilled on every runner in ``runners``, then ``steps`` decode-only
    plans of all three (for the caller to run): with 4-token blocks, contexts of 7..23 tokens
    cross several block boundaries."""
    seqs = {"a": prompt(6, 1), "b": prompt(13, 2), "c": prompt(3, 3)}
    tables = {"a": [9, 2, 14, 5, 0, 7], "b": [1, 11, 3, 8, 12, 4, 6], "c": [10, 13, 15, 16, 17]}
    prefill = StepPlan([chunk(r, t, 0, tables[r]) for r, t in seqs.items()])
    for runner in runners:
        runner.execute(prefill)
    for step in range(steps):
        for tokens in seqs.values():
            tokens.append((tokens[-1] * 31 + step) % 256)
        yield StepPlan([chunk(r, t[-1:], len(t) - 1, tables[r], step + 1) for r, t in seqs.items()])


def greedy_run(runner, steps: int = 16) -> dict[str, list[int]]:
    """Two prompts prefilled on ``runner``, then ``steps`` greedy decode steps: each
    sequence's tokens."""
    tables = {"a": [0, 1, 2, 3, 4, 5, 6, 7], "b": [8, 9, 10, 11, 12, 13, 14, 15]}
    seqs = {"a": prompt(7, 8), "b": prompt(4, 9)}
    plan = StepPlan([chunk(r, t, 0, tables[r]) for r, t in seqs.items()])
    for step in range(steps):
        for rid, token in runner.execute(plan).sampled.items():
            seqs[rid].append(token)
        plan = StepPlan(
            [chunk(r, s[-1:], len(s) - 1, tables[r], step + 1) for r, s in seqs.items()]
        )
    return seqs
