"""The workload and load options that ``splitserve bench`` and ``splitserve sim`` share, and
their ``--json`` and ``--plot`` outputs."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from splitserve.workload.report import plot, run_dict, write_json
from splitserve.workload.runs import Load, RunResult
from splitserve.workload.sessions import (
    AgenticConfig,
    LogNormal,
    MultiRoundQAConfig,
    RandomConfig,
    Workload,
)
from splitserve.workload.traces import TIMINGS, TraceScale, load_trace

WORKLOADS = ("agentic", "multi-round-qa", "mooncake", "azure", "random")
# argparse dest -> config field, per workload; only options given on the command line are
# passed, so each workload keeps its own defaults.
_FIELDS = {
    "agentic": {
        "agent_types": "agent_types",
        "system_tokens": "system_tokens",
        "task_tokens": "task_tokens",
        "tool_call_tokens": "tool_call_tokens",
        "answer_tokens": "answer_tokens",
        "tool_result_tokens": "tool_result_tokens",
        "tool_pause": "tool_pause_s",
    },
    "multi-round-qa": {
        "system_tokens": "system_tokens",
        "question_tokens": "question_tokens",
        "answer_tokens": "answer_tokens",
        "rounds": "rounds",
        "think": "think_s",
    },
    "random": {"input_len": "input_len", "output_len": "output_len"},
}
_CONFIGS = {"agentic": AgenticConfig, "multi-round-qa": MultiRoundQAConfig, "random": RandomConfig}


def add_run_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", default="agentic", choices=WORKLOADS)
    g.add_argument("--seed", type=int, default=0)
    for flag in ("agent-types", "system-tokens", "task-tokens", "tool-call-tokens"):
        g.add_argument(f"--{flag}", type=int, default=None)
    for flag in ("answer-tokens", "question-tokens", "rounds", "input-len", "output-len"):
        g.add_argument(f"--{flag}", type=int, default=None)
    g.add_argument("--tool-calls", default=None, metavar="MIN,MAX", help="agentic (default 2,6)")
    for flag in ("tool-result-tokens", "tool-pause", "think"):
        g.add_argument(f"--{flag}", type=LogNormal.parse, default=None, metavar="MEDIAN[,SIGMA]")
    g.add_argument("--trace", default=None, help="trace name or file (mooncake: conversation)")
    g.add_argument("--block-tokens", type=int, default=16, help="tokens per 512-token trace block")
    g.add_argument("--output-floor", type=int, default=4)
    g.add_argument("--max-input-len", type=int, default=2048)
    g.add_argument(
        "--trace-timing",
        default="trace",
        choices=TIMINGS,
        help="trace: its own arrival times, compressed to the rate; poisson: its requests "
        "in order at Poisson arrivals",
    )
    # Not required by argparse: `bench compare` would then need them before `compare` too.
    load = p.add_argument_group("load").add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, help="sessions (trace: requests) per second")
    load.add_argument("--sweep", default=None, metavar="R1,R2,...", help="several rates")
    load.add_argument("--concurrency", type=int, help="sessions in flight (closed loop)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    p.add_argument("--drain", type=float, default=120.0, help="seconds to let sessions finish")
    p.add_argument("--slo", default=None, metavar="ttft:MS,tpot:MS[,e2e:MS]")
    p.add_argument("--session-slo", default=None, metavar="jct:MS")
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--plot", default=None, metavar="FILE.png")
    p.add_argument("--no-progress", action="store_true")


def workload_from_args(args: argparse.Namespace) -> Workload:
    name = args.workload
    if name in ("mooncake", "azure"):
        if name == "azure" and not args.trace:
            raise ValueError("--workload azure needs --trace FILE.csv")
        scale = TraceScale(args.block_tokens, args.output_floor, args.max_input_len)
        return load_trace(name, args.trace or "conversation", scale, args.seed, args.trace_timing)
    options: dict[str, Any] = {
        field: getattr(args, dest)
        for dest, field in _FIELDS[name].items()
        if getattr(args, dest) is not None
    }
    if name == "agentic" and args.tool_calls:
        options["min_tool_calls"], options["max_tool_calls"] = _pair(args.tool_calls)
    return _CONFIGS[name](seed=args.seed, **options)


def _pair(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--tool-calls: expected MIN,MAX, got {text!r}") from None
    return lo, hi


def loads_from_args(args: argparse.Namespace) -> list[Load]:
    common = {"duration_s": args.duration, "drain_s": args.drain}
    if args.concurrency is not None:
        return [Load(concurrency=args.concurrency, **common)]
    if args.rate is not None:
        return [Load(rate=args.rate, **common)]
    if args.sweep is None:
        raise ValueError("give the load: --rate R, --sweep R1,R2,... or --concurrency C")
    try:
        rates = [float(r) for r in args.sweep.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"--sweep: expected rates like 0.5,1,2, got {args.sweep!r}") from None
    if not rates:
        raise ValueError("--sweep needs at least one rate")
    return [Load(rate=r, **common) for r in rates]


def offered(load: Load) -> float:
    return load.rate if load.rate is not None else float(load.concurrency or 0)


def write_outputs(
    args: argparse.Namespace,
    series: dict[str, list[tuple[Load, RunResult]]],
    *more: dict[str, list[tuple[Load, RunResult]]],
):
    """``--json`` and ``--plot`` for runs grouped by deployment. ``more``: the same runs
    repeated (``bench compare --repeats``); the JSON then labels each run with its repeat
    (from 1) and the plot draws the first."""
    if args.json:
        labels = [{}] if not more else [{"repeat": k} for k in range(1, len(more) + 2)]
        payload = [
            run_dict(run, deployment=name, load=load.describe(), rate=offered(load), **label)
            for label, one in zip(labels, (series, *more), strict=True)
            for name, runs in one.items()
            for load, run in runs
        ]
        write_json(args.json, payload)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        points = {name: [(offered(ld), r) for ld, r in runs] for name, runs in series.items()}
        for path in plot(args.plot, points):
            print(f"wrote {path}", file=sys.stderr)
