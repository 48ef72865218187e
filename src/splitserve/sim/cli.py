"""``splitserve sim`` (a run), ``splitserve sim plan`` and ``splitserve sim calibrate``."""

from __future__ import annotations

import argparse
import json

from splitserve.bench.metrics import SLO, format_summary
from splitserve.bench.traces import TraceScale, load_trace
from splitserve.bench.workloads import (
    AgenticConfig,
    LogNormal,
    MultiRoundQAConfig,
    RandomConfig,
    Workload,
)
from splitserve.router.policies import POLICIES
from splitserve.sim.deployment import Deployment, SimConfig
from splitserve.sim.hardware import HARDWARE, get_hardware, load_calibration
from splitserve.sim.models import DTYPE_BYTES, MODELS, get_model

WORKLOADS = ("agentic", "multi-round-qa", "random", "mooncake", "azure")


def add_sim_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "sim", help="simulate a deployment at datacenter scale (plan, calibrate: see sim -h)"
    )
    _add_run_args(p)
    p.set_defaults(func=cmd_sim)
    sub = p.add_subparsers(dest="sim_command")
    plan = sub.add_parser("plan", help="search collocated and P:D splits for goodput per GPU")
    _add_run_args(plan, deployment=False)
    plan.add_argument("--gpus", type=int, required=True)
    plan.add_argument("--tp", type=int, nargs="+", default=[1], help="TP degrees to try")
    plan.add_argument("--attainment", type=float, default=0.9, help="SLO attainment target")
    plan.add_argument(
        "--rate-range", type=float, nargs=2, default=[0.1, 50.0], metavar=("LO", "HI")
    )
    plan.add_argument("--iters", type=int, default=6, help="bisection steps per deployment")
    plan.set_defaults(func=cmd_plan)
    cal = sub.add_parser("calibrate", help="fit cpu-local's efficiency factors to this machine")
    from splitserve.sim.calibrate import add_calibrate_args, cmd_calibrate

    add_calibrate_args(cal)
    cal.set_defaults(func=cmd_calibrate)
    return p


def _add_run_args(p: argparse.ArgumentParser, deployment: bool = True) -> None:
    w = p.add_argument_group("workload (as splitserve bench)")
    w.add_argument("--workload", default="agentic", choices=WORKLOADS)
    w.add_argument("--rate", type=float, default=1.0, help="sessions per second")
    w.add_argument("--num-sessions", type=int, default=200)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--input-len", type=int, default=1024, help="random: prompt tokens")
    w.add_argument("--output-len", type=int, default=128, help="random: output tokens")
    w.add_argument("--tool-calls", type=int, nargs=2, default=[2, 6], metavar=("MIN", "MAX"))
    w.add_argument("--tool-pause", default="1.0,0.6", help="agentic: MEDIAN[,SIGMA] seconds")
    w.add_argument("--trace", default=None, help="mooncake/azure: trace file or name")
    w.add_argument("--trace-block-tokens", type=int, default=512, help="512 replays real lengths")
    w.add_argument("--max-input-tokens", type=int, default=131072)
    s = p.add_argument_group("system")
    s.add_argument("--hardware", default="h100", choices=sorted(HARDWARE))
    s.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    s.add_argument("--dtype", default=None, choices=sorted(DTYPE_BYTES), help="default bf16")
    s.add_argument("--kv-dtype", default=None, choices=sorted(DTYPE_BYTES))
    s.add_argument("--calibration", default=None, help="a `sim calibrate --out` file")
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--max-num-seqs", type=int, default=256)
    s.add_argument("--max-num-batched-tokens", type=int, default=8192)
    s.add_argument("--kv-cache-gb", type=float, default=None, help="per worker")
    s.add_argument("--policy", default="session", choices=sorted(POLICIES))
    s.add_argument("--prefill-policy", default="prefix", choices=sorted(POLICIES))
    s.add_argument("--remote-prefill-threshold", type=int, default=64)
    s.add_argument("--slo", default="ttft:2000,tpot:100", help="ttft:MS,tpot:MS[,e2e:MS]")
    s.add_argument("--session-slo", default=None, help="jct:MS")
    s.add_argument("--json", default=None, help="write the summary (and records) here")
    s.add_argument(
        "--itl", action="store_true", help="record every inter-token gap (ITL statistics)"
    )
    if deployment:
        d = p.add_argument_group("deployment")
        d.add_argument("--prefill", type=int, default=0)
        d.add_argument("--decode", type=int, default=0)
        d.add_argument("--collocated", type=int, default=None, metavar="K")
        d.add_argument("--tp", type=int, default=1)
        d.add_argument("--plot", default=None, help="PNG of TTFT and TPOT distributions")


def build_workload(args: argparse.Namespace) -> Workload:
    if not args.rate > 0:
        raise ValueError(f"--rate must be > 0 sessions/s, got {args.rate}")
    name = args.workload
    if name == "agentic":
        lo, hi = args.tool_calls
        return AgenticConfig(
            min_tool_calls=lo,
            max_tool_calls=hi,
            tool_pause_s=LogNormal.parse(args.tool_pause),
            seed=args.seed,
        )
    if name == "multi-round-qa":
        return MultiRoundQAConfig(seed=args.seed)
    if name == "random":
        return RandomConfig(args.input_len, args.output_len, seed=args.seed)
    if args.trace is None:
        raise ValueError(f"--workload {name} needs --trace FILE")
    scale = TraceScale(args.trace_block_tokens, max_input_tokens=args.max_input_tokens)
    return load_trace(name, args.trace, scale, args.seed)


def build_config(args: argparse.Namespace) -> SimConfig:
    hw = get_hardware(args.hardware)
    if args.calibration:
        hw = load_calibration(hw, args.calibration)
    dtype = args.dtype or ("fp32" if "fp32" in hw.peak_flops else "bf16")
    return SimConfig(
        model=get_model(args.model),
        hardware=hw,
        dtype=dtype,
        kv_dtype=args.kv_dtype,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_gb=args.kv_cache_gb,
        policy=args.policy,
        prefill_policy=args.prefill_policy,
        remote_prefill_threshold=args.remote_prefill_threshold,
        record_itl=args.itl,
    )


def _deployment(args: argparse.Namespace) -> Deployment:
    collocated = args.collocated
    if collocated is None:
        collocated = 0 if args.decode else 1
    return Deployment(args.prefill, args.decode, collocated, args.tp)


def cmd_sim(args: argparse.Namespace) -> int:
    from splitserve.sim.run import simulate

    if args.num_sessions < 1:
        raise ValueError("--num-sessions must be >= 1")
    slo = SLO.parse(args.slo, args.session_slo)
    result = simulate(
        build_config(args),
        _deployment(args),
        build_workload(args),
        args.rate,
        args.num_sessions,
        slo,
    )
    print(format_summary(result.summary, " Simulated Serving Result "))
    if args.json:
        with open(args.json, "w") as f:
            records = [r.to_dict() for r in result.records]
            json.dump({"summary": result.summary.to_dict(), "records": records}, f)
    if args.plot:
        from splitserve.sim.plots import latency_plot

        latency_plot(result.records, args.plot)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from splitserve.sim.plan import candidates, format_plan, plan

    if args.gpus < 1:
        raise ValueError("--gpus must be >= 1")
    slo = SLO.parse(args.slo, args.session_slo)
    rows = plan(
        build_config(args),
        build_workload(args),
        candidates(args.gpus, args.tp),
        slo,
        args.num_sessions,
        tuple(args.rate_range),
        args.attainment,
        args.iters,
    )
    print(format_plan(rows, slo, args.attainment))
    best = rows[0]
    print(f"best: {best.deployment.describe()}, {best.goodput_per_gpu:.3f} req/s per GPU")
    return 0
