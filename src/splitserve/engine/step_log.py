"""A worker's step log: every engine step's shape and how long its model run took.

``splitserve worker --step-log-dir DIR`` appends one JSON line per step to
``DIR/<role>-<port>.jsonl``; ``splitserve sim calibrate --from-steps`` fits the simulator's
cost model to those lines, so a calibration can come from a real serving run on this machine
rather than from a grid of steps timed on an idle one. The first line a worker writes is its
engine's description (``{"engine": {...}}``); each step's line holds the plan's shape in the
terms of ``sim/cost_model.py``'s ``StepShape`` (``tokens``, ``sampled``, ``attended``,
``kv_read``, ``seqs``), the model run's wall time ``seconds``, the engine thread's CPU time
over it ``cpu_seconds`` and the wall clock ``t`` (Unix seconds) at its end.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.engine.plan import StepPlan


def plan_stats(plan: StepPlan) -> tuple[int, int, float, int, int]:
    """A plan's (tokens, sampled, attended, kv_read, sequences): its new tokens, the tokens
    it samples, the query-key pairs its attention computes, the KV positions it reads, and
    the sequences in it."""
    tokens = sampled = kv_read = 0
    attended = 0.0
    for c in plan.chunks:
        n = c.num_tokens
        tokens += n
        sampled += c.sample
        attended += n * c.start_pos + n * (n + 1) / 2
        kv_read += c.context_len
    return tokens, sampled, attended, kv_read, len(plan.chunks)


def fused_decode_max_seqs(engine) -> int:
    """The most sequences a decode-only step of ``engine`` runs on its fused path (0: off)."""
    return engine.runner.fused_max_seqs


class StepLog:
    """Writes ``engine``'s steps to ``path`` (appending: a restarted worker adds a new
    engine line, then its steps). Lines are flushed as written, so a killed worker loses at
    most the step it was writing."""

    def __init__(self, path: str, engine, **about: object) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._file = open(path, "a", buffering=1)  # line-buffered
        header = {
            "threads": engine.runner.threads,
            "fused_decode_max_seqs": fused_decode_max_seqs(engine),
            "model": engine.model_id,
            "pid": os.getpid(),
            "t": time.time(),
            **about,
        }
        self._write({"engine": header})

    def __call__(self, plan: StepPlan, seconds: float, cpu_seconds: float) -> None:
        tokens, sampled, attended, kv_read, seqs = plan_stats(plan)
        self._write(
            {
                "tokens": tokens,
                "sampled": sampled,
                "attended": attended,
                "kv_read": kv_read,
                "seqs": seqs,
                "seconds": seconds,
                "cpu_seconds": cpu_seconds,
                "t": time.time(),
            }
        )

    def _write(self, row: dict) -> None:
        line = json.dumps(row, separators=(",", ":")) + "\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(line)

    def close(self) -> None:
        with self._lock:
            self._file.close()
