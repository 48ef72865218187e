"""``splitserve bench`` and ``splitserve bench compare``: the command-line front.

Register with one line in ``splitserve/cli.py``: ``add_bench_parser(sub)``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from splitserve.bench.client import Endpoint
from splitserve.bench.load import Load, RunResult, sweep
from splitserve.bench.metrics import SLO, format_summary
from splitserve.bench.report import plot, rows, run_dict, text_table, write_json
from splitserve.bench.traces import TIMINGS, TraceScale, load_trace
from splitserve.bench.workloads import (
    AgenticConfig,
    LogNormal,
    MultiRoundQAConfig,
    RandomConfig,
    Workload,
)
from splitserve.common.tls import client_context

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


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """``bench`` (one endpoint) with its ``compare`` subcommand (deployments side by side)."""
    from splitserve.bench.compare import add_compare_args, run_compare

    p = subparsers.add_parser("bench", help="benchmark an endpoint with agentic or trace traffic")
    p.add_argument("--url", default=None, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model name to send (default: the server's)")
    p.add_argument(
        "--ca",
        default=None,
        metavar="FILE",
        help="CA certificate (PEM) an https:// --url is verified against (default: "
        "$SSL_CERT_FILE, else certifi's roots)",
    )
    p.add_argument(
        "--metrics-url", nargs="+", default=[], help="more servers whose /metrics to read"
    )
    add_run_args(p)
    p.set_defaults(func=run_bench)
    inner = p.add_subparsers(dest="bench_command")
    c = inner.add_parser("compare", help="start deployments one by one and compare them")
    add_run_args(c)
    add_compare_args(c)
    c.set_defaults(func=run_compare)
    return p


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


def run_bench(args: argparse.Namespace) -> int:
    if not args.url:
        raise ValueError("give --url (or use `splitserve bench compare`)")
    workload, loads = workload_from_args(args), loads_from_args(args)
    slo = SLO.parse(args.slo, args.session_slo)
    if args.ca is not None:
        client_context(args.ca)  # a missing or bad file: one line now, not a failed run
    endpoint = Endpoint(args.url.rstrip("/"), args.api_key, args.model, ca=args.ca)
    print(workload.describe(), flush=True)
    results = sweep(endpoint, workload, loads, slo, not args.no_progress, args.metrics_url)
    for load, run in zip(loads, results, strict=True):
        print(format_summary(run.summary, f" {load.describe()} "), flush=True)
    if len(results) > 1:
        runs = [("-", ld.describe(), r.summary) for ld, r in zip(loads, results, strict=True)]
        print(text_table(rows(runs)))
    write_outputs(args, {"endpoint": list(zip(loads, results, strict=True))})
    return 0


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


def main(argv: list[str] | None = None) -> int:
    """``python -m splitserve.bench.cli ...``: the same as ``splitserve bench ...``."""
    parser = argparse.ArgumentParser(prog="splitserve")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])])
    try:
        return args.func(args)
    except ValueError as e:
        print(f"splitserve bench: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
