"""How much goodput moves when the machine is a few percent faster or slower than its
calibration (every simulated step scaled by the same factor):

- ``--part small-case``: the small validation case of ``tests/sim/test_validate.py`` for
  several objectives in units of a lone prefill and a lone decode step. An objective that
  sits where requests crowd makes a 15% comparison of goodput a coin toss; this finds ones
  that do not.
- ``--part four-workers``: `bench compare`'s four one-thread workers on two cores (agentic
  sessions at 0.35/s, docs/benchmarks.md), round-robin and the tiered deployment.

    .venv/bin/python benchmarks/sim_speed_sensitivity.py --calibration benchmarks/out/cal-q2.json
"""

from __future__ import annotations

import argparse

from splitserve.config import EngineConfig
from splitserve.sim.cost_model import StepShape
from splitserve.sim.deployment import Deployment, SimConfig
from splitserve.sim.hardware import HardwareProfile, get_hardware, load_calibration
from splitserve.sim.models import get_model
from splitserve.sim.run import SimResult, simulate
from splitserve.workload.metrics import SLO
from splitserve.workload.sessions import AgenticConfig, LogNormal, RandomConfig

SCALES = (0.9, 0.95, 1.0, 1.05, 1.1)
OBJECTIVES = ((2.5, 3.0), (1.75, 4.0), (1.75, 3.5), (1.5, 4.0))  # (TTFT prefills, TPOT steps)


def run(hw: HardwareProfile, duration: float, rate: float) -> SimResult:
    eng = EngineConfig()
    cfg = SimConfig(
        get_model("smollm2-135m"),
        hw,
        dtype="fp32",
        block_size=eng.block_size,
        kv_cache_gb=eng.kv_cache_gb,
        max_num_seqs=eng.max_num_seqs,
        max_num_batched_tokens=eng.max_num_batched_tokens,
    )
    workload = RandomConfig(input_len=64, output_len=8, seed=1)
    return simulate(cfg, Deployment(collocated=1), workload, rate, duration)


def met(result: SimResult, ttft_s: float, tpot_s: float) -> int:
    slo = SLO(ttft_ms=1000 * ttft_s, tpot_ms=1000 * tpot_s)
    return sum(1 for r in result.records if slo.met(r))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--part", choices=["small-case", "four-workers"], default="small-case")
    ap.add_argument("--rate", type=float, default=1.25, help="small case: requests/s")
    ap.add_argument("--durations", type=float, nargs="+", default=[16.0, 48.0])
    args = ap.parse_args()
    hw = load_calibration(get_hardware("cpu-local"), args.calibration)
    if args.part == "four-workers":
        four_workers(hw)
        return
    cost = run(hw, 1.0, args.rate).cluster.cost
    prefill = cost.step_time(StepShape(64, 1, 64 * 65 / 2, 64, 1))
    decode = cost.step_time(StepShape(1, 1, 65, 65, 1))
    print(f"lone prefill {1000 * prefill:.1f} ms, lone decode step {1000 * decode:.1f} ms")
    print("requests meeting both objectives, relative to the calibrated speed, steps scaled by")
    print(
        f"{'requests':>9} {'TTFT':>5} {'TPOT':>5} {'met':>6}  "
        + "  ".join(f"{s:>4}" for s in SCALES)
    )
    for duration in args.durations:
        runs = {s: run(hw.steps_scaled(s), duration, args.rate) for s in SCALES}
        n = len(runs[1.0].records)
        for tt, tp in OBJECTIVES:
            base = met(runs[1.0], tt * prefill, tp * decode)
            ratios = (met(r, tt * prefill, tp * decode) / max(base, 1) for r in runs.values())
            line = "  ".join(f"{r:.2f}" for r in ratios)
            print(f"{n:>9} {tt:>5g} {tp:>5g} {base:>3}/{n:<2}  {line}")


# docs/benchmarks.md's four-worker agentic setting, as `bench compare` ran it.
AGENTIC = AgenticConfig(
    agent_types=4,
    system_tokens=256,
    task_tokens=32,
    min_tool_calls=3,
    max_tool_calls=5,
    tool_call_tokens=8,
    answer_tokens=16,
    tool_result_tokens=LogNormal(64, 0.5),
    tool_pause_s=LogNormal(3.0, 0.5),
    seed=0,
)
FOUR_WORKERS = {
    "collocated-rr": dict(policy="round-robin"),
    "collocated-session-tiers (floor 3)": dict(host_kv_gb=2.0, load_floor=3),
}
FOUR_SCALES = (0.9, 1.0, 1.1, 1.2, 1.3)


def four_workers(hw: HardwareProfile) -> None:
    slo = SLO(ttft_ms=1000, tpot_ms=250)
    print("goodput (req/s) and p50 TTFT (ms), steps scaled by " + ", ".join(map(str, FOUR_SCALES)))
    for name, settings in FOUR_WORKERS.items():
        cells = []
        for scale in FOUR_SCALES:
            cfg = SimConfig(
                get_model("smollm2-135m"),
                hw.steps_scaled(scale),
                dtype="fp32",
                kv_cache_gb=0.06,
                max_num_seqs=64,
                max_num_batched_tokens=1024,
                chat_template=True,
                host_cores=2,
                **settings,
            )
            s = simulate(cfg, Deployment(collocated=4), AGENTIC, 0.35, 120.0, slo).summary
            cells.append(f"{s.request_goodput:.3f} ({s.ttft.median:.0f})")
        print(f"{name:<36}" + "  ".join(cells))


if __name__ == "__main__":
    main()
