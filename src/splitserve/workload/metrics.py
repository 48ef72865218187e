"""Per-request records, SLOs, goodput and the summary, shared by the client and the simulator.

Definitions (those of ``vllm bench serve`` and DistServe):

- TTFT: request sent -> first token received. ITL: gaps between later tokens.
- TPOT: (E2E - TTFT) / (output tokens - 1), per request; undefined for one-token replies.
- goodput: requests per second that met *every* request SLO (ttft, tpot, e2e); failed
  requests never meet it. SLO attainment: the fraction of all requests that met it.
- session goodput: sessions per second whose every turn met the request SLO and whose job
  completion time (first request sent -> last token of the last turn, tool pauses included)
  met ``jct``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 95, 99)
_SLO_KEYS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2e": "e2e_ms", "e2el": "e2e_ms"}


@dataclass(slots=True)
class RequestRecord:
    """What one request did. Times in seconds; ``start_s`` from the run's start."""

    session_id: str
    turn: int
    start_s: float
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    error: str = ""

    @property
    def end_s(self) -> float:
        return self.start_s + self.e2e_s

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class SLO:
    """Latency objectives in milliseconds; None: no objective on that figure."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    jct_ms: float | None = None  # per session

    @classmethod
    def parse(cls, request: str | None = None, session: str | None = None) -> SLO:
        """``ttft:500,tpot:50[,e2e:MS]`` and ``jct:MS``."""
        values: dict[str, float] = {}
        for text, keys in ((request, _SLO_KEYS), (session, {"jct": "jct_ms"})):
            for item in (text or "").split(","):
                if not item.strip():
                    continue
                key, _, ms = item.partition(":")
                if key.strip() not in keys:
                    raise ValueError(f"unknown SLO {key.strip()!r}; use {', '.join(keys)}")
                try:
                    values[keys[key.strip()]] = float(ms)
                except ValueError:
                    raise ValueError(f"SLO {item!r}: expected NAME:MILLISECONDS") from None
        return cls(**values)

    def met(self, r: RequestRecord) -> bool:
        """Did the request succeed and meet every request objective?"""
        if not r.ok:
            return False
        checks = ((self.ttft_ms, r.ttft_s), (self.tpot_ms, r.tpot_s), (self.e2e_ms, r.e2e_s))
        return all(slo is None or (v is not None and v * 1000 <= slo) for slo, v in checks)

    def describe(self) -> str:
        fields = (
            (f.name.removesuffix("_ms"), getattr(self, f.name)) for f in dataclasses.fields(self)
        )
        return " ".join(f"{name}<={ms:g}ms" for name, ms in fields if ms is not None) or "none"


@dataclass(frozen=True, slots=True)
class SessionRecord:
    session_id: str
    start_s: float
    end_s: float
    turns: int
    ok: bool  # every turn succeeded
    met: bool  # every turn met the request SLO and the JCT met the session SLO

    @property
    def jct_s(self) -> float:
        return self.end_s - self.start_s


def session_records(records: Iterable[RequestRecord], slo: SLO) -> list[SessionRecord]:
    """One record per session, from its requests."""
    by_session: dict[str, list[RequestRecord]] = {}
    for r in records:
        by_session.setdefault(r.session_id, []).append(r)
    out = []
    for sid, rs in by_session.items():
        start, end = min(r.start_s for r in rs), max(r.end_s for r in rs)
        ok = all(r.ok for r in rs)
        jct_ok = slo.jct_ms is None or (end - start) * 1000 <= slo.jct_ms
        met = ok and jct_ok and all(slo.met(r) for r in rs)
        out.append(SessionRecord(sid, start, end, len(rs), ok, met))
    return out


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile with linear interpolation (numpy's default, as vLLM); NaN if none."""
    return float(np.percentile(values, p)) if len(values) else math.nan


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: dict[int, float]

    @classmethod
    def of(cls, seconds: Sequence[float]) -> LatencyStats:
        ms = [s * 1000 for s in seconds]
        if not ms:
            return cls(math.nan, math.nan, math.nan, {p: math.nan for p in PERCENTILES})
        return cls(
            float(np.mean(ms)),
            float(np.median(ms)),
            float(np.std(ms)),
            {p: percentile(ms, p) for p in PERCENTILES},
        )


@dataclass(frozen=True, slots=True)
class Summary:
    """Everything a run measured; ``to_dict()`` is the JSON form."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    cached_tokens: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    slo_attainment: float
    sessions: int
    sessions_ok: int
    session_goodput: float
    session_attainment: float
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats
    jct: LatencyStats
    slo: SLO
    errors: dict[str, int]
    server: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)  # workload, scale, rate, deployment

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    slo: SLO = SLO(),
    server: dict[str, float] | None = None,
    info: dict[str, Any] | None = None,
) -> Summary:
    """The summary of a run that took ``duration_s`` (first request sent -> last finished)."""
    ok = [r for r in records if r.ok]
    sessions = session_records(records, slo)
    good = sum(slo.met(r) for r in records)
    n_in = sum(r.prompt_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    per_s = 1.0 / duration_s if duration_s > 0 else math.nan
    return Summary(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        cached_tokens=sum(r.cached_tokens for r in ok),
        request_throughput=len(ok) * per_s,
        request_goodput=good * per_s,
        output_throughput=n_out * per_s,
        total_token_throughput=(n_in + n_out) * per_s,
        slo_attainment=good / len(records) if records else math.nan,
        sessions=len(sessions),
        sessions_ok=sum(s.ok for s in sessions),
        session_goodput=sum(s.met for s in sessions) * per_s,
        session_attainment=sum(s.met for s in sessions) / len(sessions) if sessions else math.nan,
        ttft=LatencyStats.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot=LatencyStats.of([t for r in ok if (t := r.tpot_s) is not None]),
        itl=LatencyStats.of([x for r in ok for x in r.itl_s]),
        e2e=LatencyStats.of([r.e2e_s for r in ok]),
        jct=LatencyStats.of([s.jct_s for s in sessions if s.ok]),
        slo=slo,
        errors=_error_counts(records),
        server=dict(server or {}),
        info=dict(info or {}),
    )


def _error_counts(records: Iterable[RequestRecord]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        if not r.ok:
            counts[r.error or "unknown"] = counts.get(r.error or "unknown", 0) + 1
    return counts


def _line(label: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{label:<40} {value:<10.2f}"
    return f"{label:<40} {value:<10}"


def _rule(title: str, fill: str = "-") -> str:
    return f"{title:{fill}^50}"


def _latency_block(title: str, short: str, stats: LatencyStats) -> list[str]:
    return [
        _rule(title),
        _line(f"Mean {short} (ms):", stats.mean),
        _line(f"Median {short} (ms):", stats.median),
        _line(f"P99 {short} (ms):", stats.percentiles[99]),
    ]


def format_summary(s: Summary, title: str = " Serving Benchmark Result ") -> str:
    """The ``vllm bench serve`` layout, then sessions, SLOs and the servers' own counters."""
    lines = [
        _rule(title, "="),
        _line("Successful requests:", s.completed),
        _line("Failed requests:", s.failed),
        _line("Benchmark duration (s):", s.duration_s),
        _line("Total input tokens:", s.total_input_tokens),
        _line("Total generated tokens:", s.total_output_tokens),
        _line("Request throughput (req/s):", s.request_throughput),
        _line("Request goodput (req/s):", s.request_goodput),
        _line("Output token throughput (tok/s):", s.output_throughput),
        _line("Total Token throughput (tok/s):", s.total_token_throughput),
        *_latency_block("Time to First Token", "TTFT", s.ttft),
        *_latency_block("Time per Output Token (excl. 1st token)", "TPOT", s.tpot),
        *_latency_block("Inter-token Latency", "ITL", s.itl),
        *_latency_block("End-to-end Latency", "E2EL", s.e2e),
        _rule("Sessions and SLOs"),
        _line("SLO:", s.slo.describe()),
        _line("SLO attainment (%):", 100 * s.slo_attainment),
        _line("Sessions (all turns ok / total):", f"{s.sessions_ok}/{s.sessions}"),
        _line("Session goodput (sessions/s):", s.session_goodput),
        _line("Session SLO attainment (%):", 100 * s.session_attainment),
        _line("Mean session JCT (ms):", s.jct.mean),
    ]
    if s.server:
        lines.append(_rule("Servers (/metrics, after - before)"))
        lines += [_line(f"{name}:", value) for name, value in s.server.items()]
    if s.errors:
        lines.append(_rule("Errors"))
        lines += [_line(f"{err[:38]}:", n) for err, n in sorted(s.errors.items())]
    for key, value in s.info.items():
        if key == "workers":  # [{"url": ..., "role": ...}]: the router's workers
            value = ", ".join(f"{w['url']} ({w['role']})" for w in value)
        lines.append(f"{key}: {value}")
    lines.append("=" * 50)
    return "\n".join(lines)
