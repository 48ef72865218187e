"""The 2.5x question and the maps of where disaggregation wins (docs/simulator.md).

The reported MORI-IO setup: Qwen3-235B-A22B in FP8 on one node of 8 MI300X, 1 prefill +
1 decode worker at TP4 against 2 collocated workers at TP4, 2000-token prompts, 1000-token
outputs, 8 requests/s. Prints the predicted goodput ratio under several SLOs (and the ratio
of the highest rates each deployment sustains within the SLO), then sweeps prompt length x
output length x rate and, for agentic sessions, tool calls x tool pause, drawing heat maps.

    .venv/bin/python benchmarks/sim_questions.py --img docs/img
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from splitserve.sim.deployment import Deployment, SimConfig
from splitserve.sim.hardware import get_hardware
from splitserve.sim.models import get_model
from splitserve.sim.plan import max_rate
from splitserve.sim.plots import ratio_map
from splitserve.sim.run import simulate
from splitserve.workload.metrics import SLO, summarize
from splitserve.workload.sessions import AgenticConfig, LogNormal, RandomConfig

DISAGG = Deployment(prefill=1, decode=1, tp=4)
COLLOCATED = Deployment(collocated=2, tp=4)
SLOS = (
    SLO(ttft_ms=2000, tpot_ms=50),
    SLO(ttft_ms=1000, tpot_ms=25),
    SLO(ttft_ms=500, tpot_ms=21),
)
ITL_P99_MS = 25.0  # a per-request objective on the 99th percentile inter-token gap
RUN = {"steady_s": 120.0}  # seconds of arrivals per run: several request lifetimes
AGENTIC_RATE = 48.0  # sessions/s: enough to load the node


MAX_NUM_SEQS = 1024  # vLLM's default for its API server on GPUs with >= 70 GiB


def mori_config(max_num_seqs: int = MAX_NUM_SEQS) -> SimConfig:
    return SimConfig(
        get_model("qwen3-235b-a22b"),
        get_hardware("mi300x"),
        dtype="fp8",
        kv_dtype="bf16",
        max_num_seqs=max_num_seqs,
        record_itl=True,
    )


def itl_goodput(result, slo: SLO) -> float:
    """Requests/s meeting ``slo`` and a P99 inter-token gap <= ITL_P99_MS."""
    s = result.summary
    good = sum(
        slo.met(r) and r.itl_s and np.percentile(r.itl_s, 99) * 1000 <= ITL_P99_MS
        for r in result.records
    )
    return good / s.duration_s


def mori(cfg: SimConfig, max_rates: bool) -> None:
    workload = RandomConfig(input_len=2000, output_len=1000)
    runs = {d: simulate(cfg, d, workload, 8.0, RUN["steady_s"]) for d in (DISAGG, COLLOCATED)}
    print("## The MORI-IO setup at 8 req/s (claimed: 2.5x)\n")
    print("| SLO | disagg goodput | collocated goodput | ratio |")
    print("|---|---|---|---|")
    for slo in SLOS:
        good = [_resummarize(runs[d], slo).request_goodput for d in runs]
        print(f"| {slo.describe()} | {good[0]:.2f} | {good[1]:.2f} | {good[0] / good[1]:.2f} |")
    slo = SLOS[0]
    good = [itl_goodput(runs[d], slo) for d in runs]
    print(
        f"| {slo.describe()} and per-request P99 ITL<={ITL_P99_MS:g}ms | {good[0]:.2f} | "
        f"{good[1]:.2f} | {good[0] / max(good[1], 1e-9):.2f} |"
    )
    for d, r in runs.items():
        s = r.summary
        print(
            f"\n{d.describe()}: TTFT p50 {s.ttft.median:.0f} ms p99 {s.ttft.percentiles[99]:.0f} "
            f"ms; TPOT p50 {s.tpot.median:.1f} ms; ITL p50 {s.itl.median:.1f} ms p99 "
            f"{s.itl.percentiles[99]:.1f} ms; busy {s.server['mean worker busy (%)']:.0f}%"
        )
    if not max_rates:
        return
    print("\nHighest rate (req/s) with >= 90% SLO attainment:\n")
    for slo in SLOS:
        rates = []
        for d in (DISAGG, COLLOCATED):

            def probe(rate, d=d, slo=slo):
                s = simulate(cfg, d, workload, rate, RUN["steady_s"], slo).summary
                return s.slo_attainment, s.request_goodput

            rates.append(max_rate(probe, 1.0, 64.0, 0.9, 7)[0])
        print(
            f"- {slo.describe()}: disagg {rates[0]:.1f}, collocated {rates[1]:.1f}, "
            f"ratio {rates[0] / max(rates[1], 1e-9):.2f}"
        )


def sweep(cfg: SimConfig, img: str) -> None:
    slo = SLOS[0]
    prompts, outputs, rates = (500, 2000, 8000), (100, 500, 1000), (4, 8, 16)
    print(f"\n## Goodput ratio disagg / collocated, SLO {slo.describe()}\n")
    for rate in rates:
        grid = []
        for p in prompts:
            row = []
            for o in outputs:
                w = RandomConfig(input_len=p, output_len=o)
                runs = [simulate(cfg, d, w, rate, RUN["steady_s"], slo) for d in _pair()]
                g = [r.summary.request_goodput for r in runs]
                row.append(g[0] / g[1] if g[1] > 0 else float("nan"))
            grid.append(row)
        print(f"rate {rate} req/s (rows: prompt {prompts}, columns: output {outputs}):")
        for p, row in zip(prompts, grid, strict=True):
            print(f"  {p:>5}: " + "  ".join(f"{v:5.2f}" for v in row))
        ratio_map(
            os.path.join(img, f"sim_ratio_rate{rate}.png"),
            f"Qwen3-235B FP8, 8 MI300X, 1P+1D TP4 vs 2x TP4, {rate} req/s, {slo.describe()}",
            [str(o) for o in outputs],
            [str(p) for p in prompts],
            grid,
            "output tokens",
            "prompt tokens",
        )


def agentic(cfg: SimConfig, img: str) -> None:
    slo = SLOS[0]
    calls, pauses = (1, 4, 8), (0.1, 1.0, 5.0)
    grid = []
    for c in calls:
        row = []
        for pause in pauses:
            w = AgenticConfig(min_tool_calls=c, max_tool_calls=c, tool_pause_s=LogNormal(pause))
            runs = [simulate(cfg, d, w, AGENTIC_RATE, RUN["steady_s"] / 2, slo) for d in _pair()]
            g = [r.summary.request_goodput for r in runs]
            row.append(g[0] / g[1] if g[1] > 0 else float("nan"))
        grid.append(row)
    print(f"\n## Agentic sessions at {AGENTIC_RATE:g} sessions/s, SLO {slo.describe()}")
    print(f"rows: tool calls {calls}, columns: tool pause {pauses} s")
    for c, row in zip(calls, grid, strict=True):
        print(f"  {c:>2}: " + "  ".join(f"{v:5.2f}" for v in row))
    ratio_map(
        os.path.join(img, "sim_ratio_agentic.png"),
        f"agentic sessions, {AGENTIC_RATE:g} sessions/s, same node and SLO {slo.describe()}",
        [f"{p:g}" for p in pauses],
        [str(c) for c in calls],
        grid,
        "tool pause (s, median)",
        "tool calls per session",
    )


def _resummarize(result, slo: SLO):
    s = result.summary
    return summarize(result.records, s.duration_s, slo, s.server, s.info)


def _pair() -> tuple[Deployment, Deployment]:
    return DISAGG, COLLOCATED


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--img", default="docs/img")
    ap.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS)
    ap.add_argument("--steady", type=float, default=RUN["steady_s"], help="seconds of arrivals")
    ap.add_argument("--parts", default="mori,max-rate,sweep,agentic")
    args = ap.parse_args()
    RUN["steady_s"] = args.steady
    parts = set(args.parts.split(","))
    cfg = mori_config(args.max_num_seqs)
    print(f"max_num_seqs {cfg.max_num_seqs}, max_num_batched_tokens 8192, block 16, KV bf16")
    os.makedirs(args.img, exist_ok=True)
    t = time.perf_counter()
    if "mori" in parts:
        mori(cfg, "max-rate" in parts)
    if "sweep" in parts:
        sweep(cfg, args.img)
    if "agentic" in parts:
        agentic(cfg, args.img)
    print(f"\n(simulated in {time.perf_counter() - t:.0f} s wall)")


if __name__ == "__main__":
    main()
