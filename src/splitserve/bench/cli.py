"""``splitserve bench`` and ``splitserve bench compare``: the command-line front.

Register with one line in ``splitserve/cli.py``: ``add_bench_parser(sub)``.
"""

from __future__ import annotations

import argparse
import sys

from splitserve.bench.client import Endpoint
from splitserve.bench.load import sweep
from splitserve.common.tls import client_context
from splitserve.workload.args import (
    add_run_args,
    loads_from_args,
    workload_from_args,
    write_outputs,
)
from splitserve.workload.metrics import SLO, format_summary
from splitserve.workload.report import rows, text_table


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
