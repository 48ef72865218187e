"""Tables (text and markdown), JSON and plots of benchmark runs.

A row is one run (one load on one deployment). In a comparison every figure is followed by
its ratio to the first deployment's run at the same load.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from splitserve.workload.metrics import Summary
from splitserve.workload.runs import RunResult

# (column, figure, higher is better)
FIGURES: list[tuple[str, Callable[[Summary], float], bool]] = [
    ("goodput req/s", lambda s: s.request_goodput, True),
    ("session goodput /s", lambda s: s.session_goodput, True),
    ("SLO att. %", lambda s: 100 * s.slo_attainment, True),
    ("req/s", lambda s: s.request_throughput, True),
    ("TTFT p50 ms", lambda s: s.ttft.median, False),
    ("TTFT p99 ms", lambda s: s.ttft.percentiles[99], False),
    ("TPOT p50 ms", lambda s: s.tpot.median, False),
    ("JCT mean s", lambda s: s.jct.mean / 1000, False),
    ("cache hit %", lambda s: 100 * _cache_hit_rate(s), True),
    ("turns moved %", lambda s: 100 * s.server.get("turns_moved_fraction", math.nan), False),
    ("KV MB moved", lambda s: s.server.get("kv_bytes_transferred", math.nan) / 1e6, True),
]


def _cache_hit_rate(s: Summary) -> float:
    """Cached prompt tokens / prompt tokens: from the workers' counters, or from the
    responses' ``cached_tokens`` where the workers have no such counter (vLLM)."""
    if s.server.get("prompt_tokens"):
        return s.server.get("prefix_cache_hit_rate", math.nan)
    return s.cached_tokens / s.total_input_tokens if s.total_input_tokens else math.nan


RATIO_FIGURES = {"goodput req/s", "session goodput /s", "req/s", "TTFT p50 ms", "TTFT p99 ms"}


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "-"
    return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"


def _ratio(v: float, base: float) -> str:
    if math.isnan(v) or math.isnan(base) or base == 0:
        return "" if v == base else " (-)"
    return f" ({v / base:.2f}x)"


def rows(runs: Sequence[tuple[str, str, Summary]], ratios: bool = False) -> list[list[str]]:
    """``runs``: (deployment, load, summary). With ``ratios``, each ratio figure also shows
    its ratio to the first deployment's summary at the same load."""
    first: dict[str, Summary] = {}
    for _, load, s in runs:
        first.setdefault(load, s)
    out = []
    for dep, load, s in runs:
        row = [dep, load]
        for name, fig, _ in FIGURES:
            cell = _fmt(fig(s))
            if ratios and name in RATIO_FIGURES:
                cell += _ratio(fig(s), fig(first[load]))
            row.append(cell)
        row.append(str(s.failed))
        out.append(row)
    return out


HEADERS = ["deployment", "load", *(name for name, _, _ in FIGURES), "failed"]


# Figures averaged over a comparison's repeats, after the goodput columns.
MEAN_FIGURES = ["session goodput /s", "SLO att. %", "TTFT p50 ms", "turns moved %"]
MEAN_HEADERS = [
    "deployment",
    "load",
    "runs",
    "goodput mean req/s",
    "min",
    "max",
    "ratio of means",
    *(f"{name} mean" for name in MEAN_FIGURES),
]


def mean_rows(groups: Sequence[tuple[str, str, Sequence[Summary]]]) -> list[list[str]]:
    """``groups``: (deployment, load, its summaries over repeated runs). One row each: mean,
    min and max goodput, the ratio of its mean to the first deployment's mean at the same
    load, and the means of ``MEAN_FIGURES``."""
    figures = {name: fig for name, fig, _ in FIGURES}
    base: dict[str, float] = {}
    out = []
    for dep, load, summaries in groups:
        goodput = [s.request_goodput for s in summaries]
        mean = statistics.fmean(goodput)
        first = base.setdefault(load, mean)
        ratio = f"{mean / first:.2f}x" if first > 0 else "-"
        row = [dep, load, str(len(summaries)), _fmt(mean), _fmt(min(goodput)), _fmt(max(goodput))]
        row.append(ratio)
        row += [_fmt(statistics.fmean(figures[n](s) for s in summaries)) for n in MEAN_FIGURES]
        out.append(row)
    return out


def text_table(table: list[list[str]], headers: Sequence[str] = HEADERS) -> str:
    widths = [max(len(h), *(len(r[i]) for r in table)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in table]
    return "\n".join(lines)


def markdown_table(table: list[list[str]], headers: Sequence[str] = HEADERS) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in table]
    return "\n".join(lines)


def _finite(obj: Any) -> Any:
    """JSON has no NaN: undefined figures become null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def run_dict(run: RunResult, **labels: Any) -> dict[str, Any]:
    return {
        **labels,
        "summary": run.summary.to_dict(),
        "requests": [r.to_dict() for r in run.records],
    }


def write_json(path: str | Path, payload: Any) -> None:
    Path(path).write_text(json.dumps(_finite(payload), indent=1) + "\n")


def plot(path: str | Path, series: dict[str, list[tuple[float, RunResult]]]) -> list[Path]:
    """Two PNGs: goodput and session goodput vs offered rate (``path``), and the TTFT CDF of
    each series' highest-rate run (``<path stem>_ttft_cdf.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, runs in series.items():
        rates = [rate for rate, _ in runs]
        goodput = [r.summary.request_goodput for _, r in runs]
        (line,) = ax.plot(rates, goodput, "o-", label=f"{name} goodput")
        sessions = [r.summary.session_goodput for _, r in runs]
        ax.plot(rates, sessions, "s--", color=line.get_color(), label=f"{name} sessions")
    ax.set(xlabel="offered load (sessions/s)", ylabel="per second", title="Goodput vs load")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    cdf_path = path.with_name(f"{path.stem}_ttft_cdf.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, runs in series.items():
        rate, run = runs[-1]
        ttfts = sorted(1000 * r.ttft_s for r in run.records if r.ok and r.ttft_s is not None)
        ys = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
        ax.step(ttfts, ys, where="post", label=f"{name} @ {rate:g}/s")
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF", xscale="log")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(cdf_path)
    plt.close(fig)
    return [path, cdf_path]
