"""``splitserve router``: the command-line front of the router.

Register it with one line in ``splitserve/cli.py``: ``add_router_parser(sub)``; the parser's
default ``func`` is ``run``. ``python -m splitserve.router.cli ...`` runs it standalone.
"""

from __future__ import annotations

import argparse
import os
import sys

from splitserve.common.access_log import add_access_log_args, max_bytes
from splitserve.common.body_limit import add_max_body_arg
from splitserve.common.tenant_args import add_api_keys_arg, read_secret
from splitserve.common.tls import add_server_tls_args, add_worker_ca_arg, server_files, uvicorn_tls
from splitserve.router.config import (
    DEFAULT_REMOTE_PREFILL_THRESHOLD,
    WORKER_ENGINES,
    RouterConfig,
)
from splitserve.router.policies import POLICIES
from splitserve.router.ring import DEFAULT_LOAD_FACTOR, DEFAULT_LOAD_FLOOR


def add_router_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``router`` subcommand to ``subparsers``; returns its parser."""
    p = subparsers.add_parser("router", help="session-aware router in front of workers")
    add_router_args(p)
    p.set_defaults(func=run)
    return p


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--decode", nargs="+", default=[], metavar="URL", help="decode workers")
    p.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="prefill workers")
    p.add_argument(
        "--workers", nargs="+", default=[], metavar="URL", help="collocated workers (role both)"
    )
    add_placement_args(p)
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (default: $SPLITSERVE_API_KEY)",
    )
    add_api_keys_arg(p)
    p.add_argument(
        "--kv-secret-file",
        default=None,
        metavar="FILE",
        help="the cluster secret: the router signs each request's tenant with it "
        "(default: $SPLITSERVE_KV_SECRET; needed with --api-keys)",
    )
    p.add_argument(
        "--admin-key",
        default=None,
        help="key for /workers (default: $SPLITSERVE_ADMIN_KEY, else the API key)",
    )
    p.add_argument(
        "--worker-api-key",
        default=None,
        help="key sent to the workers (default: $SPLITSERVE_WORKER_API_KEY, "
        "else the client's own Authorization header)",
    )
    p.add_argument("--health-interval", type=float, default=1.0, metavar="SECONDS")
    p.add_argument("--max-retries", type=int, default=2)
    p.add_argument(
        "--disaggregate",
        action="store_true",
        help="run the two-leg prefill/decode flow when prefill workers exist",
    )
    p.add_argument(
        "--kv-prefetch-hints",
        action="store_true",
        help="send each session turn's prompt to its decode worker ahead of the request, so "
        "KV in its host-RAM/disk tiers is promoted while the request is routed",
    )
    p.add_argument(
        "--kv-events",
        action="append",
        default=[],
        metavar="WORKER_URL=ENDPOINT[,REPLAY]",
        help="subscribe to a worker's KV events (its --kv-events-endpoint, or vLLM's "
        "--kv-events-config endpoint), and ask its replay endpoint (,tcp://HOST:PORT) for "
        "missed batches, for --policy kv-events; repeat per worker",
    )
    p.add_argument("--kv-events-topic", default="", help="the workers' KV events topic")
    add_max_body_arg(p)
    add_access_log_args(p)
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="model directory (tokenizer.json, chat template) the router tokenizes prompts "
        "with, as the workers do, for --policy kv-events",
    )
    p.add_argument(
        "--worker-engine",
        default="builtin",
        choices=WORKER_ENGINES,
        help="what the workers run: vllm servers know no tenants, so the router gives each "
        "request its tenant's KV salt as vLLM's cache_salt (default: builtin)",
    )
    add_server_tls_args(p)
    add_worker_ca_arg(p, "the router verifies")
    p.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )


def add_placement_args(p: argparse.ArgumentParser, prefill_policy: bool = True) -> None:
    """The placement options (``router.placement``) of ``router``, ``serve`` and ``sim``."""
    g = p.add_argument_group("placement")
    g.add_argument(
        "--policy",
        default="session",
        choices=sorted(POLICIES),
        help="decode placement (default: session)",
    )
    if prefill_policy:
        g.add_argument(
            "--prefill-policy",
            default="prefix",
            choices=sorted(POLICIES),
            help="prefill placement (default: prefix)",
        )
    g.add_argument(
        "--load-factor",
        type=float,
        default=DEFAULT_LOAD_FACTOR,
        metavar="C",
        help="session policy: a worker holds at most ceil(C x average) requests "
        f"(default {DEFAULT_LOAD_FACTOR}; with W workers, C >= W never moves a session)",
    )
    g.add_argument(
        "--load-floor",
        type=int,
        default=DEFAULT_LOAD_FLOOR,
        metavar="N",
        help="session policy: a session's home worker counts as full only from N requests "
        f"in flight, whatever C gives (default {DEFAULT_LOAD_FLOOR})",
    )
    g.add_argument(
        "--remote-prefill-threshold",
        type=int,
        default=DEFAULT_REMOTE_PREFILL_THRESHOLD,
        metavar="TOKENS",
        help="prefill remotely only when the uncached prompt is at least this long "
        f"(default {DEFAULT_REMOTE_PREFILL_THRESHOLD})",
    )
    g.add_argument(
        "--kv-peer-fetch",
        action="store_true",
        help="a session turn placed off its busy home worker names the home (kv_peer), and "
        "the chosen worker pulls the session's KV from it instead of recomputing it",
    )


def _kv_events(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        url, sep, endpoint = pair.partition("=")
        if not (sep and url and endpoint):
            raise SystemExit(
                f"splitserve router: --kv-events wants WORKER_URL=ENDPOINT[,REPLAY], got {pair!r}"
            )
        out[url] = endpoint
    return out


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The ``RouterConfig`` the parsed arguments describe (environment keys as fallbacks)."""
    if not (args.decode or args.workers):
        raise SystemExit("splitserve router: give at least one --decode or --workers URL")
    return RouterConfig(
        decode=args.decode,
        prefill=args.prefill,
        workers=args.workers,
        policy=args.policy,
        prefill_policy=args.prefill_policy,
        load_factor=args.load_factor,
        load_floor=args.load_floor,
        api_key=args.api_key or os.environ.get("SPLITSERVE_API_KEY") or None,
        admin_key=args.admin_key or os.environ.get("SPLITSERVE_ADMIN_KEY") or None,
        worker_api_key=args.worker_api_key or os.environ.get("SPLITSERVE_WORKER_API_KEY") or None,
        api_keys_file=args.api_keys or os.environ.get("SPLITSERVE_API_KEYS") or None,
        cluster_secret=read_secret(args.kv_secret_file),
        health_interval_s=args.health_interval,
        max_retries=args.max_retries,
        disaggregate=args.disaggregate,
        remote_prefill_threshold=args.remote_prefill_threshold,
        prefetch_hints=args.kv_prefetch_hints,
        kv_peer_fetch=args.kv_peer_fetch,
        kv_events=_kv_events(args.kv_events),
        kv_events_topic=args.kv_events_topic,
        tokenizer=args.tokenizer,
        worker_ca=args.worker_ca,
        worker_engine=args.worker_engine,
        max_body_bytes=int(args.max_body_mb * 2**20),
        access_log=args.access_log,
        access_log_max_bytes=max_bytes(args.access_log_max_mb),
    )


def run(args: argparse.Namespace) -> int:
    """Serve the router until interrupted."""
    from splitserve.common.gc_pauses import quiet_gc
    from splitserve.common.listen import bind_port, serve
    from splitserve.router.app import create_app
    from splitserve.router.server import RouterProtocol

    tls = server_files(args.ssl_certfile, args.ssl_keyfile)
    config = config_from_args(args)
    sock = bind_port(args.host, args.port, "splitserve router")
    app = create_app(config)
    quiet_gc()
    serve(
        app,
        sock,
        log_level=args.log_level,
        access_log=False,
        http=RouterProtocol,  # arrival times (the "queued" phase), direct body writes
        proxy_headers=False,  # the router never uses the client's address
        **uvicorn_tls(tls),
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splitserve router", description=__doc__)
    add_router_args(parser)
    try:
        return run(parser.parse_args(argv))
    except ValueError as e:  # bad input: one line, as ``splitserve router`` prints it
        print(f"splitserve router: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
