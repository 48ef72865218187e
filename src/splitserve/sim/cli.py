"""``splitserve sim`` (a run), ``splitserve sim plan`` and ``splitserve sim calibrate``."""

from __future__ import annotations

import argparse

from splitserve.config import SCHEDULING_POLICIES
from splitserve.router.cli import add_placement_args
from splitserve.sim.deployment import Deployment, SimConfig
from splitserve.sim.hardware import HARDWARE, get_hardware, load_calibration
from splitserve.sim.models import DTYPE_BYTES, MODELS, get_model
from splitserve.workload.args import (
    add_run_args,
    loads_from_args,
    workload_from_args,
    write_outputs,
)
from splitserve.workload.metrics import SLO, format_summary
from splitserve.workload.runs import Load


def add_sim_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    # No abbreviations: `sim calibrate --out` must not be read as bench's `--output-len`.
    p = subparsers.add_parser(
        "sim",
        help="simulate a deployment at datacenter scale (plan, calibrate: see sim -h)",
        allow_abbrev=False,
    )
    _add_run_args(p)
    p.add_argument(
        "--gen-workers",
        type=int,
        default=0,
        choices=[0, 1],
        help="1: make the sessions' random draws ahead in a second process (large runs)",
    )
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
    """``splitserve bench``'s workload, load, SLO and output options, then the system."""
    add_run_args(p)
    add_placement_args(p)
    s = p.add_argument_group("simulated system")
    s.add_argument("--hardware", default="h100", choices=sorted(HARDWARE))
    s.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    s.add_argument("--dtype", default=None, choices=sorted(DTYPE_BYTES), help="default bf16")
    s.add_argument("--kv-dtype", default=None, choices=sorted(DTYPE_BYTES))
    s.add_argument("--calibration", default=None, help="a `sim calibrate --out` file")
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--max-num-seqs", type=int, default=256)
    s.add_argument("--max-num-batched-tokens", type=int, default=8192)
    s.add_argument("--kv-cache-gb", type=float, default=None, help="per worker")
    s.add_argument(
        "--host-kv-gb", type=float, default=0.0, help="host-RAM KV tier per worker (0: none)"
    )
    s.add_argument(
        "--disk-kv-gb", type=float, default=0.0, help="local-disk KV tier per worker (0: none)"
    )
    s.add_argument("--scheduling-policy", default="fcfs", choices=list(SCHEDULING_POLICIES))
    s.add_argument(
        "--host-cores",
        type=int,
        default=None,
        metavar="N",
        help="the workers share N CPU cores (one thread each, as bench compare runs them), "
        "with the serving work a calibration file measured (benchmarks/serving_cpu.py)",
    )
    s.add_argument(
        "--itl", action="store_true", help="record every inter-token gap (ITL statistics)"
    )
    s.add_argument(
        "--chat-template",
        action="store_true",
        help="chat sessions' prompts carry the chat template's tokens (ChatML)",
    )
    if deployment:
        d = p.add_argument_group("deployment")
        d.add_argument("--prefill", type=int, default=0)
        d.add_argument("--decode", type=int, default=0)
        d.add_argument("--collocated", type=int, default=None, metavar="K")
        d.add_argument("--tp", type=int, default=1)


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
        host_kv_gb=args.host_kv_gb,
        disk_kv_gb=args.disk_kv_gb,
        policy=args.policy,
        prefill_policy=args.prefill_policy,
        load_factor=args.load_factor,
        load_floor=args.load_floor,
        scheduling_policy=args.scheduling_policy,
        remote_prefill_threshold=args.remote_prefill_threshold,
        kv_peer_fetch=args.kv_peer_fetch,
        host_cores=args.host_cores,
        record_itl=args.itl,
        chat_template=args.chat_template,
    )


def _deployment(args: argparse.Namespace) -> Deployment:
    collocated = args.collocated
    if collocated is None:
        collocated = 0 if args.decode else 1
    return Deployment(args.prefill, args.decode, collocated, args.tp)


def _rates(args: argparse.Namespace) -> list[Load]:
    loads = loads_from_args(args)
    if any(load.rate is None for load in loads):
        raise ValueError("the simulator runs open loops: give --rate or --sweep")
    return loads


def cmd_sim(args: argparse.Namespace) -> int:
    from splitserve.sim.run import simulate

    workload, loads = workload_from_args(args), _rates(args)
    slo = SLO.parse(args.slo, args.session_slo)
    config, dep = build_config(args), _deployment(args)
    print(workload.describe(), flush=True)
    runs = []
    for load in loads:
        result = simulate(config, dep, workload, load.rate, load.duration_s, slo, args.gen_workers)
        print(format_summary(result.summary, f" Simulated: {load.describe()} "), flush=True)
        runs.append((load, result.run))
    write_outputs(args, {dep.describe(): runs})
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from splitserve.sim.plan import candidates, format_plan, plan

    if args.gpus < 1:
        raise ValueError("--gpus must be >= 1")
    slo = SLO.parse(args.slo, args.session_slo)
    rows = plan(
        build_config(args),
        workload_from_args(args),
        candidates(args.gpus, args.tp),
        slo,
        args.duration,
        tuple(args.rate_range),
        args.attainment,
        args.iters,
    )
    print(format_plan(rows, slo, args.attainment))
    lo, hi = args.rate_range
    if any(r.max_rate >= hi - (hi - lo) / 2**args.iters for r in rows):
        print(f"note: some deployments meet the SLO at the top of --rate-range ({hi:g}); raise it")
    best = rows[0]
    print(f"best: {best.deployment.describe()}, {best.goodput_per_gpu:.3f} req/s per GPU")
    return 0
