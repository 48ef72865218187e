"""Trace replay: Mooncake JSONL (``hash_ids`` of 512-token blocks) and Azure LLM CSV.

Traces carry lengths and, for Mooncake, which prompt blocks requests share, but no text.
Replay synthesizes token ids so that the sharing is exactly the trace's and scales lengths
down for small machines: every 512-token trace block becomes ``block_tokens`` synthetic
tokens, a function of its hash id alone::

    trace  hash_ids [7, 8, 9]       input_length 1300 = 512 + 512 + 276
    scaled          [b7][b8][b9']   16 + 16 + round(276 * 16/512) = 41 tokens

    b_h = [h % R, h // R, rng(seed, h) ...] + TOKEN_ID_LO   (R = 48,000, the id range)

The first two ids of a block name its hash id, so two requests sharing k leading hash ids
share exactly k blocks of tokens: the next blocks differ in their first token, or, for ids
equal modulo R (rare: the Mooncake traces' ids stay below 4R), in their second, which still
never completes another cache block. The partial last block keeps two tokens for that.
Outputs scale by the same factor with a floor. Each request is a single-turn session; its
arrival is its timestamp, compressed to the requested rate.
"""

from __future__ import annotations

import csv
import functools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from importlib import resources
from pathlib import Path

import numpy as np

from splitserve.workload.sessions import (
    API_COMPLETIONS,
    TOKEN_ID_HI,
    TOKEN_ID_LO,
    Segment,
    SessionSpec,
    TurnSpec,
    poisson_arrivals,
    token_ids,
)

TRACE_BLOCK_TOKENS = 512
TIMINGS = ("trace", "poisson")
_ID_RANGE = TOKEN_ID_HI - TOKEN_ID_LO
_BLOCKS, _UNSHARED, _OUTPUTS = 3, 4, 5  # random streams of one seed


def traces_dir() -> Path:
    """``$SPLITSERVE_TRACES_DIR``, else the traces shipped in the package
    (``splitserve/workload/data/traces``: the Mooncake FAST'25 traces and their license)."""
    env = os.environ.get("SPLITSERVE_TRACES_DIR")
    if env:
        return Path(env)
    return Path(str(resources.files("splitserve.workload").joinpath("data", "traces")))


def resolve_trace(name: str) -> Path:
    """A trace file by path, or by name in ``traces_dir()`` (``conversation`` finds
    ``mooncake_conversation_trace.jsonl``); a clear error when it is nowhere."""
    if Path(name).is_file():
        return Path(name)
    base = traces_dir()
    for candidate in (name, f"{name}.jsonl", f"mooncake_{name}_trace.jsonl"):
        if (base / candidate).is_file():
            return base / candidate
    raise ValueError(
        f"trace {name!r} not found (looked at that path and in {base}; "
        "set SPLITSERVE_TRACES_DIR or give a file path)"
    )


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = ()


def parse_mooncake(lines: Iterator[str] | list[str]) -> list[TraceRequest]:
    """Mooncake JSONL lines: ``timestamp`` (ms), ``input_length``, ``output_length``,
    ``hash_ids``."""
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            out.append(
                TraceRequest(
                    float(d["timestamp"]) / 1000.0,
                    int(d["input_length"]),
                    int(d["output_length"]),
                    tuple(int(h) for h in d["hash_ids"]),
                )
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"trace line {n}: not a Mooncake request ({e})") from e
    return out


def parse_azure(lines: Iterator[str] | list[str]) -> list[TraceRequest]:
    """Azure LLM inference CSV: ``TIMESTAMP`` (datetime or seconds), ``ContextTokens``,
    ``GeneratedTokens``; timestamps become seconds after the first."""
    rows = list(csv.DictReader(lines))
    try:
        stamps = [_seconds(r["TIMESTAMP"]) for r in rows]
        t0 = min(stamps, default=0.0)
        return [
            TraceRequest(t - t0, int(r["ContextTokens"]), int(r["GeneratedTokens"]))
            for t, r in zip(stamps, rows, strict=True)
        ]
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(
            f"not an Azure trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens): {e}"
        ) from e


def _seconds(stamp: str) -> float:
    try:
        return float(stamp)
    except ValueError:
        pass
    # "2023-11-16 18:15:46.6805900": seven fraction digits, more than datetime parses.
    head, _, frac = stamp.strip().partition(".")
    return datetime.fromisoformat(head).timestamp() + (float(f"0.{frac}") if frac else 0.0)


@dataclass(frozen=True, slots=True)
class TraceScale:
    """How a trace shrinks: 512-token blocks to ``block_tokens``, outputs by the same
    factor (at least ``output_floor``); requests longer than ``max_input_tokens`` after
    scaling are skipped (and counted)."""

    block_tokens: int = 16
    output_floor: int = 4
    max_input_tokens: int = 2048

    def __post_init__(self) -> None:
        if not 2 <= self.block_tokens <= TRACE_BLOCK_TOKENS:
            raise ValueError(f"block_tokens must be in [2, 512], got {self.block_tokens}")
        if self.output_floor < 1 or self.max_input_tokens < 1:
            raise ValueError("output_floor and max_input_tokens must be >= 1")

    @property
    def factor(self) -> float:
        return self.block_tokens / TRACE_BLOCK_TOKENS

    def output_len(self, trace_len: int) -> int:
        return max(self.output_floor, round(trace_len * self.factor))

    def describe(self) -> str:
        return (
            f"scale: 512-token blocks -> {self.block_tokens} tokens "
            f"(lengths x1/{TRACE_BLOCK_TOKENS // self.block_tokens}), "
            f"outputs floor {self.output_floor}, inputs <= {self.max_input_tokens} tokens"
        )


@functools.lru_cache(maxsize=65536)
def block_ids(hash_id: int, block_tokens: int, seed: int) -> tuple[int, ...]:
    """The synthetic block named ``hash_id``."""
    if not 0 <= hash_id < _ID_RANGE * _ID_RANGE:
        raise ValueError(f"hash id {hash_id} out of range")
    rng = np.random.default_rng([seed, _BLOCKS, hash_id])
    head = (TOKEN_ID_LO + hash_id % _ID_RANGE, TOKEN_ID_LO + hash_id // _ID_RANGE)
    return (head + token_ids(rng, max(0, block_tokens - 2)))[:block_tokens]


def _block_lengths(req: TraceRequest, scale: TraceScale) -> list[int]:
    """Scaled length of each block: full ones, then the last in proportion to the trace's
    partial block (at least two tokens)."""
    n = len(req.hash_ids)
    if n == 0:
        return []
    tail = req.input_length - TRACE_BLOCK_TOKENS * (n - 1)
    last = min(scale.block_tokens, max(2, round(tail * scale.factor)))
    return [scale.block_tokens] * (n - 1) + [last]


def synthesize_prompt(req: TraceRequest, scale: TraceScale, seed: int) -> list[int]:
    """Token ids of a Mooncake request: one scaled block per hash id."""
    ids: list[int] = []
    for h, n in zip(req.hash_ids, _block_lengths(req, scale), strict=True):
        ids += block_ids(h, scale.block_tokens, seed)[:n]
    return ids


@dataclass(frozen=True, slots=True)
class TraceReplay:
    """A trace as a workload: single-turn sessions at the trace's arrival times, compressed
    to ``rate`` requests per second when one is given (None: the trace's own timeline).

    ``timing="poisson"`` keeps the requests and their order but draws Poisson arrivals at
    ``rate``: compressing the Mooncake traces' timeline also compresses their bursts (their
    timestamps come in 3 s steps, up to 16 requests on one), which a small machine cannot
    absorb at any rate it can otherwise sustain.
    """

    requests: tuple[TraceRequest, ...]
    source: str
    scale: TraceScale = TraceScale()
    seed: int = 0
    name: str = field(default="mooncake")
    timing: str = "trace"

    def __post_init__(self) -> None:
        if self.timing not in TIMINGS:
            raise ValueError(f"timing must be one of {', '.join(TIMINGS)}, got {self.timing!r}")

    @property
    def native_rate(self) -> float:
        span = self.requests[-1].timestamp_s - self.requests[0].timestamp_s
        return (len(self.requests) - 1) / span if span > 0 else float("inf")

    def sessions(self, rate: float | None) -> Iterator[SessionSpec]:
        poisson = poisson_arrivals(rate, self.seed)
        for i, req in enumerate(self.requests):
            if not self._fits(req):
                continue
            out = self.scale.output_len(req.output_length)
            rng = np.random.default_rng([self.seed, _OUTPUTS, i])
            prompt = Segment("prompt", tuple(self._prompt(i, req)))
            turn = TurnSpec(0.0, (prompt,), out, token_ids(rng, out))
            arrival = next(poisson) if self.timing == "poisson" else self._arrival(req, rate)
            yield SessionSpec(f"r{i}", arrival, 0, (turn,), API_COMPLETIONS, sticky=False)

    def _arrival(self, req: TraceRequest, rate: float | None) -> float:
        speedup = 1.0 if rate is None else rate / self.native_rate
        return (req.timestamp_s - self.requests[0].timestamp_s) / speedup

    def _input_len(self, req: TraceRequest) -> int:
        if req.hash_ids:
            return sum(_block_lengths(req, self.scale))
        return max(1, round(req.input_length * self.scale.factor))

    def _fits(self, req: TraceRequest) -> bool:
        return self._input_len(req) <= self.scale.max_input_tokens

    def _prompt(self, i: int, req: TraceRequest) -> list[int]:
        if req.hash_ids:
            return synthesize_prompt(req, self.scale, self.seed)
        rng = np.random.default_rng([self.seed, _UNSHARED, i])
        return list(token_ids(rng, self._input_len(req)))

    def skipped(self) -> int:
        """Requests too long for ``max_input_tokens`` after scaling."""
        return sum(not self._fits(r) for r in self.requests)

    def describe(self) -> str:
        timing = "Poisson arrivals" if self.timing == "poisson" else "trace arrivals"
        return (
            f"{self.name} trace {self.source}: {len(self.requests)} requests at "
            f"{self.native_rate:.2f} req/s native, {timing}; {self.scale.describe()}"
        )


def load_trace(
    kind: str, name: str, scale: TraceScale = TraceScale(), seed: int = 0, timing: str = "trace"
) -> TraceReplay:
    """``kind`` ``mooncake`` (JSONL) or ``azure`` (CSV), read from ``resolve_trace(name)``,
    sorted by arrival."""
    path = resolve_trace(name)
    parse = {"mooncake": parse_mooncake, "azure": parse_azure}[kind]
    with open(path, newline="") as f:
        requests = sorted(parse(f), key=lambda r: r.timestamp_s)
    if not requests:
        raise ValueError(f"trace {path} holds no requests")
    return TraceReplay(tuple(requests), path.name, scale, seed, kind, timing)
