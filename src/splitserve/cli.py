"""The ``splitserve`` command."""

from __future__ import annotations

import argparse
import os
import sys

from splitserve.bench.cli import add_bench_parser
from splitserve.common.protocol import DEFAULT_KV_PEER_TIMEOUT_S as DEFAULT_PEER_TIMEOUT_S
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.scheduler import SCHEDULING_POLICIES
from splitserve.router.cli import add_router_parser
from splitserve.router.config import DEFAULT_REMOTE_PREFILL_THRESHOLD
from splitserve.router.policies import POLICIES
from splitserve.router.ring import DEFAULT_LOAD_FACTOR, DEFAULT_LOAD_FLOOR
from splitserve.sim.cli import add_sim_parser


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="GGUF file or HF model directory (default: bundled SmolLM2-135M-Instruct)",
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None, help="CPU threads for the model")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV cache pool size")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--max-num-seqs", type=int, default=None, help="most requests in one batch (default 64)"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget of one engine step; longer prompts are prefilled in chunks "
        "(default 1024)",
    )
    p.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=list(SCHEDULING_POLICIES),
        help="which waiting request starts next: arrival order, or the one with the fewest "
        "uncached prompt tokens (default fcfs)",
    )
    p.add_argument(
        "--split-gemv",
        action="store_true",
        help="split decode steps' weight products across --threads (faster on idle cores, "
        "much slower when other processes hold them)",
    )


def _engine_options(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype,
        threads=args.threads,
        kv_cache_gb=args.kv_cache_gb,
        max_model_len=args.max_model_len,
        split_gemv=args.split_gemv,
        scheduling_policy=args.scheduling_policy,
        **{
            name: getattr(args, name)
            for name in ("max_num_seqs", "max_num_batched_tokens")
            if getattr(args, name) is not None
        },
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from splitserve.entrypoints.llm import LLM

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )
    llm = LLM(model=args.model, **_engine_options(args))
    if args.raw:
        out = llm.generate(args.prompt, params)[0]
    else:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    print(out.outputs[0].text)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from splitserve.config import EngineConfig
    from splitserve.worker.main import run_worker

    disagg = _disagg_config(args)
    config = EngineConfig.from_kwargs(
        model=args.model,
        kv_tiers=_tier_config(args),
        kv_cache_shm=disagg.shares_kv_cache,
        **_engine_options(args),
    )
    run_worker(
        config,
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get("SPLITSERVE_API_KEY") or None,
        max_waiting=args.max_waiting,
        served_model_name=args.served_model_name,
        log_level=args.log_level,
        disagg=disagg,
    )
    return 0


# The KV tier flags: (flag, KVTierConfig field). ``serve`` passes the same flags on.
_TIER_FLAGS = (
    ("--host-kv-gb", "host_kv_gb"),
    ("--disk-kv-dir", "disk_kv_dir"),
    ("--disk-kv-gb", "disk_kv_gb"),
    ("--kv-encryption-key-file", "encryption_key_file"),
    ("--kv-retention-ttl-s", "retention_ttl_s"),
    ("--kv-retention-max-ttl-s", "retention_max_ttl_s"),
    ("--kv-retention-quota", "retention_quota"),
    ("--kv-retention-max-pinned", "retention_max_pinned"),
)


def _add_kv_tier_args(p: argparse.ArgumentParser) -> None:
    from splitserve.config import KVTierConfig

    d = KVTierConfig()
    g = p.add_argument_group("KV tiers (see docs/kv-tiers.md)")
    g.add_argument("--host-kv-gb", type=float, default=d.host_kv_gb, help="host-RAM KV tier size")
    g.add_argument("--disk-kv-dir", default=None, help="directory of the disk KV tier (persists)")
    g.add_argument("--disk-kv-gb", type=float, default=d.disk_kv_gb, help="disk KV tier size")
    g.add_argument(
        "--kv-encryption-key-file", default=None, help="encrypt the disk tier (splitserve keygen)"
    )
    g.add_argument(
        "--kv-retention-ttl-s",
        type=float,
        default=d.retention_ttl_s,
        help="seconds a session's KV stays pinned after tool calls or kv_retention {}",
    )
    g.add_argument(
        "--kv-retention-max-ttl-s",
        type=float,
        default=d.retention_max_ttl_s,
        help="the longest kv_retention.ttl_s a request may ask for",
    )
    g.add_argument(
        "--kv-retention-quota",
        type=float,
        default=d.retention_quota,
        help="blocks one session may pin, as a fraction of the device pool",
    )
    g.add_argument(
        "--kv-retention-max-pinned",
        type=float,
        default=d.retention_max_pinned,
        help="blocks all sessions together may pin, as a fraction of the device pool",
    )


def _tier_config(args: argparse.Namespace):
    """The tier flags as a config; a bad key file fails here, before the model loads."""
    from splitserve.config import KVTierConfig
    from splitserve.kvstore import load_key

    cfg = KVTierConfig(**{field: getattr(args, field_of(flag)) for flag, field in _TIER_FLAGS})
    if cfg.encryption_key_file is not None:
        load_key(cfg.encryption_key_file)
    return cfg


def field_of(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def _tier_worker_args(args: argparse.Namespace) -> list[str]:
    """The tier flags given to ``serve``, for its workers' command lines."""
    out: list[str] = []
    for flag, _ in _TIER_FLAGS:
        value = getattr(args, field_of(flag))
        if value is not None:
            out += [flag, str(value)]
    return out


def cmd_keygen(args: argparse.Namespace) -> int:
    from splitserve.kvstore import generate_key

    try:
        path = generate_key(args.path)
    except OSError as e:
        raise ValueError(f"cannot write the key file {args.path}: {e.strerror}") from e
    print(f"wrote a new 256-bit KV encryption key to {path} (mode 600)")
    return 0


def _disagg_config(args: argparse.Namespace):
    from splitserve.worker.disagg import DisaggConfig

    return DisaggConfig(
        role=args.role,
        transport=args.kv_transport,
        kv_host=args.kv_host or args.host,
        kv_port=args.kv_port,
        secret=_read_secret(args.kv_secret_file),
        encrypt=args.kv_encrypt,
        shm_checksums=args.kv_shm_checksums,
        lease_ttl_s=args.kv_lease_ttl,
        failure_policy=args.kv_load_failure_policy,
        fault=args.kv_test_fault,
        peer=args.kv_peer,
        peer_timeout_s=args.kv_peer_timeout,
    )


def _read_secret(path: str | None) -> bytes:
    """The cluster secret for KV transfers: from a file, else $SPLITSERVE_KV_SECRET."""
    if path is None:
        return os.environ.get("SPLITSERVE_KV_SECRET", "").encode()
    try:
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as e:
        raise ValueError(f"cannot read the KV secret file {path}: {e.strerror}") from e
    if not secret:
        raise ValueError(f"the KV secret file {path} is empty")
    return secret


def _add_kv_transfer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-transport",
        default="tcp",
        choices=["tcp", "shm"],
        help="how a prefill worker serves KV blocks (shm: same host only)",
    )
    p.add_argument("--kv-host", default=None, help="KV transfer bind address (default: --host)")
    p.add_argument("--kv-port", type=int, default=0, help="KV transfer port (default: any free)")
    p.add_argument(
        "--kv-secret-file",
        default=None,
        help="cluster secret for KV transfers (default: $SPLITSERVE_KV_SECRET)",
    )
    p.add_argument("--kv-encrypt", action="store_true", help="encrypt KV payloads (AES-GCM)")
    p.add_argument(
        "--kv-shm-checksums",
        action="store_true",
        help="checksum shm transfers too (off: leased blocks cannot change under the copy)",
    )
    p.add_argument(
        "--kv-lease-ttl",
        type=float,
        default=30.0,
        help="seconds a prefill worker holds KV for a decode worker to pull",
    )
    p.add_argument(
        "--kv-load-failure-policy",
        default="recompute",
        choices=["recompute", "fail"],
        help="when a KV pull fails: prefill locally (default) or fail the request",
    )
    p.add_argument(
        "--kv-peer",
        action="store_true",
        help="peer KV fetch: lend cached KV to other workers (POST /v1/kv/lease) and pull a "
        "moved session's KV from the home worker a request names (kv_peer); needs the secret",
    )
    p.add_argument(
        "--kv-peer-timeout",
        type=float,
        default=DEFAULT_PEER_TIMEOUT_S,
        metavar="SECONDS",
        help="how long to wait for a peer's lease answer before computing locally "
        f"(default {DEFAULT_PEER_TIMEOUT_S:g})",
    )
    p.add_argument("--kv-test-fault", default=None, help=argparse.SUPPRESS)


def serve_topology(args: argparse.Namespace):
    """The pools and router flags ``serve`` starts, from its parsed arguments."""
    from splitserve.cluster.local import Topology

    if args.load_factor < 1.0:
        raise ValueError(f"--load-factor must be >= 1, got {args.load_factor}")
    if args.load_floor < 1:
        raise ValueError(f"--load-floor must be >= 1, got {args.load_floor}")
    return Topology(
        prefill=args.prefill,
        decode=args.decode,
        threads_per_worker=args.threads_per_worker,
        kv_transport=args.kv_transport,
        kv_peer=args.kv_peer_fetch,
        kv_peer_timeout_s=args.kv_peer_timeout,
        router_args=[
            *("--remote-prefill-threshold", str(args.remote_prefill_threshold)),
            *("--policy", args.policy),
            *("--load-factor", str(args.load_factor)),
            *("--load-floor", str(args.load_floor)),
            *(["--kv-peer-fetch"] if args.kv_peer_fetch else []),
        ],
    )


def serve_worker_args(args: argparse.Namespace) -> list[str]:
    """The engine and tier flags ``serve`` passes to every worker it starts."""
    worker_args = ["--dtype", args.dtype, "--kv-cache-gb", str(args.kv_cache_gb)]
    worker_args += ["--scheduling-policy", args.scheduling_policy]
    worker_args += _tier_worker_args(args)
    for flag, value in (
        ("--threads", args.threads),
        ("--max-model-len", args.max_model_len),
        ("--max-num-seqs", args.max_num_seqs),
        ("--max-num-batched-tokens", args.max_num_batched_tokens),
        ("--max-waiting", args.max_waiting),
    ):
        if value is not None:
            worker_args += [flag, str(value)]
    return worker_args


def cmd_serve(args: argparse.Namespace) -> int:
    from splitserve.cluster.local import serve
    from splitserve.config import EngineConfig

    topology = serve_topology(args)
    _tier_config(args)  # bad tier flags fail here, not in every worker
    EngineConfig.from_kwargs(**_engine_options(args))  # and bad engine options
    return serve(
        host=args.host,
        port=args.port,
        model=args.model,
        worker_args=serve_worker_args(args),
        api_key=args.api_key or os.environ.get("SPLITSERVE_API_KEY") or None,
        ready_timeout=args.ready_timeout,
        topology=topology,
    )


def _add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (default: $SPLITSERVE_API_KEY)",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        help="answer 429 when this many requests are already waiting",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a reply offline and print it")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument(
        "--raw", action="store_true", help="send the prompt as is, without the chat template"
    )
    _add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    worker = sub.add_parser("worker", help="serve one engine over the OpenAI HTTP API")
    worker.add_argument("--role", default="both", choices=["both", "prefill", "decode"])
    worker.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send (default: the model's id)",
    )
    worker.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    _add_server_args(worker)
    _add_engine_args(worker)
    _add_kv_transfer_args(worker)
    _add_kv_tier_args(worker)
    worker.set_defaults(func=cmd_worker)

    serve = sub.add_parser(
        "serve", help="start a deployment: one collocated worker, or P/D pools behind the router"
    )
    serve.add_argument("--prefill", type=int, default=0, metavar="N", help="prefill workers")
    serve.add_argument("--decode", type=int, default=0, metavar="M", help="decode workers")
    serve.add_argument("--threads-per-worker", type=int, default=None, metavar="T")
    serve.add_argument("--kv-transport", default="tcp", choices=["tcp", "shm"])
    serve.add_argument(
        "--remote-prefill-threshold",
        type=int,
        default=DEFAULT_REMOTE_PREFILL_THRESHOLD,
        metavar="TOKENS",
        help="prefill remotely only when the uncached prompt is at least this long",
    )
    serve.add_argument(
        "--policy",
        default="session",
        choices=sorted(POLICIES),
        help="the router's decode placement (default: session)",
    )
    serve.add_argument(
        "--load-factor",
        type=float,
        default=DEFAULT_LOAD_FACTOR,
        metavar="C",
        help="session policy: a worker holds at most ceil(C x average) requests "
        f"(default {DEFAULT_LOAD_FACTOR}; with W workers, C >= W never moves a session)",
    )
    serve.add_argument(
        "--load-floor",
        type=int,
        default=DEFAULT_LOAD_FLOOR,
        metavar="N",
        help="session policy: a session's home worker counts as full only from N requests "
        f"in flight, whatever C gives (default {DEFAULT_LOAD_FLOOR})",
    )
    serve.add_argument(
        "--kv-peer-fetch",
        action="store_true",
        help="a session turn the router moves off its busy home worker pulls the session's "
        "KV from the home instead of recomputing it (docs/router.md)",
    )
    serve.add_argument(
        "--kv-peer-timeout",
        type=float,
        default=DEFAULT_PEER_TIMEOUT_S,
        metavar="SECONDS",
        help="with --kv-peer-fetch: how long a worker waits for the home's lease answer "
        f"before computing locally (default {DEFAULT_PEER_TIMEOUT_S:g})",
    )
    serve.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for the workers to load their model",
    )
    _add_server_args(serve)
    _add_engine_args(serve)
    _add_kv_tier_args(serve)
    serve.set_defaults(func=cmd_serve)

    keygen = sub.add_parser("keygen", help="write a new key for --kv-encryption-key-file")
    keygen.add_argument("path", help="where to write the key (refuses to overwrite)")
    keygen.set_defaults(func=cmd_keygen)
    add_router_parser(sub)
    add_bench_parser(sub)
    add_sim_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad input: a clear message, not a traceback
        print(f"splitserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
