"""The ``splitserve`` command."""

from __future__ import annotations

import argparse
import os
import sys

from splitserve.bench.cli import add_bench_parser
from splitserve.cli_kv import (
    add_kv_parser,
    add_kv_tier_args,
    add_kv_transfer_args,
    cmd_keygen,
    disagg_config,
    tier_config,
    tier_worker_args,
)
from splitserve.cli_ray import add_cluster_parser, add_ray_serve_args, cmd_serve_ray, ray_plan
from splitserve.cli_vllm import (
    add_engine_choice,
    lora_args,
    run_vllm_worker_from_args,
    serve_vllm_args,
)
from splitserve.common.access_log import add_access_log_args
from splitserve.common.access_log import max_bytes as access_log_bytes
from splitserve.common.body_limit import add_max_body_arg
from splitserve.common.cpus import bind_to, parse_cpus
from splitserve.common.kv_events import add_kv_events_args
from splitserve.common.protocol import DEFAULT_KV_PEER_TIMEOUT_S as DEFAULT_PEER_TIMEOUT_S
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.tenant_args import add_api_keys_arg, tenants_from_args
from splitserve.common.tls import add_server_tls_args, add_worker_ca_arg, server_files
from splitserve.config import SCHEDULING_POLICIES
from splitserve.router.cli import add_placement_args, add_router_parser
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
        help="split decode steps' weight products across --threads on plain weights (faster "
        "on idle cores, much slower when other processes hold them); packed weights, the CPU "
        "default, always use every thread",
    )
    p.add_argument(
        "--fused-decode",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run small decode-only steps (<= 4 sequences) through one compiled kernel per step "
        "(default on; --no-fused-decode keeps the torch ops)",
    )


def _engine_options(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype,
        threads=args.threads,
        kv_cache_gb=args.kv_cache_gb,
        max_model_len=args.max_model_len,
        split_gemv=args.split_gemv,
        fused_decode=args.fused_decode,
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
    if args.engine == "vllm":
        return run_vllm_worker_from_args(args)
    lora_args(args)  # refused: the builtin engine runs no LoRA
    from splitserve.config import EngineConfig

    if args.cpus is not None:
        cores = parse_cpus(args.cpus)
        bind_to(cores)  # before the engine's threads start: they inherit it
        if args.threads is None:
            args.threads = len(cores)
    disagg = disagg_config(args)
    config = EngineConfig.from_kwargs(
        model=args.model,
        kv_tiers=tier_config(args),
        kv_cache_shm=disagg.shares_kv_cache,
        **_engine_options(args),
    )
    from splitserve.worker.main import run_worker  # torch: only once the flags are good

    run_worker(
        config,
        host=args.host,
        port=args.port,
        tenants=tenants_from_args(args),
        max_waiting=args.max_waiting,
        served_model_name=args.served_model_name,
        log_level=args.log_level,
        disagg=disagg,
        step_log_dir=args.step_log_dir,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        tls=server_files(args.ssl_certfile, args.ssl_keyfile),
        max_body_bytes=int(args.max_body_mb * 2**20),
        access_log=args.access_log,
        access_log_max_bytes=access_log_bytes(args.access_log_max_mb),
    )
    return 0


def serve_topology(args: argparse.Namespace):
    """The pools and router flags ``serve`` starts, from its parsed arguments."""
    from splitserve.cluster.serve import Topology

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
        kv_encrypt=args.kv_encrypt,
        kv_peer_timeout_s=args.kv_peer_timeout,
        engine=args.engine,
        kv_events_tokenizer=_router_tokenizer(args),
        router_args=[
            *("--remote-prefill-threshold", str(args.remote_prefill_threshold)),
            *("--policy", args.policy),
            *("--load-factor", str(args.load_factor)),
            *("--load-floor", str(args.load_floor)),
            *(["--kv-peer-fetch"] if args.kv_peer_fetch else []),
            *access_log_args(args, ".router"),
        ],
    )


def _router_tokenizer(args: argparse.Namespace) -> str | None:
    """With ``--policy kv-events``, the model directory the router tokenizes prompts with."""
    if args.policy != "kv-events" or not args.decode:
        return None
    from splitserve.models.hf_export import hf_model_dir
    from splitserve.models.loader import default_model_path

    return hf_model_dir(args.model or default_model_path())


def serve_worker_args(args: argparse.Namespace) -> list[str]:
    """The engine and tier flags ``serve`` passes to every worker it starts."""
    if args.engine == "vllm":
        return serve_vllm_args(args)
    worker_args = ["--dtype", args.dtype, "--kv-cache-gb", str(args.kv_cache_gb)]
    worker_args += ["--scheduling-policy", args.scheduling_policy]
    worker_args += tier_worker_args(args)
    for flag, value in (
        ("--threads", args.threads),
        ("--max-model-len", args.max_model_len),
        ("--max-num-seqs", args.max_num_seqs),
        ("--max-num-batched-tokens", args.max_num_batched_tokens),
        ("--max-waiting", args.max_waiting),
        ("--step-log-dir", args.step_log_dir),
    ):
        if value is not None:
            worker_args += [flag, str(value)]
    return worker_args + access_log_args(args)


def access_log_args(args: argparse.Namespace, suffix: str = "") -> list[str]:
    """``serve``'s access log flags for one of its processes: each writes its own file
    (``PATH.router``; a pool's workers ``PATH.<name>``, ``cluster.local.own_access_log``)."""
    if args.access_log is None:
        return []
    access_log_bytes(args.access_log_max_mb)  # a bad size fails here, not in every process
    mb = str(args.access_log_max_mb)
    return ["--access-log", f"{args.access_log}{suffix}", "--access-log-max-mb", mb]


def _checked_keys_file(args: argparse.Namespace) -> str | None:
    """The keys file ``serve`` passes on, read once here so a bad one fails before any
    worker starts."""
    tenants_from_args(args)
    return args.api_keys or os.environ.get("SPLITSERVE_API_KEYS") or None


def cmd_serve(args: argparse.Namespace) -> int:
    from splitserve.cluster.serve import serve
    from splitserve.config import EngineConfig

    topology = serve_topology(args)
    lora_args(args)  # refused for builtin; a bad adapter fails here, not in every worker
    tier_config(args)  # bad tier flags fail here, not in every worker
    EngineConfig.from_kwargs(**_engine_options(args))  # and bad engine options
    api_key = args.api_key or os.environ.get("SPLITSERVE_API_KEY") or None
    if args.ray is not None:
        plan = ray_plan(args, topology, serve_worker_args(args), api_key, _checked_keys_file(args))
        return cmd_serve_ray(args, plan)
    return serve(
        host=args.host,
        port=args.port,
        model=args.model,
        worker_args=serve_worker_args(args),
        api_key=api_key,
        api_keys_file=_checked_keys_file(args),
        ready_timeout=args.ready_timeout,
        topology=topology,
        tls=args.tls,
    )


def _add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (default: $SPLITSERVE_API_KEY)",
    )
    add_api_keys_arg(p)
    p.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        help="answer 429 when this many requests are already waiting",
    )
    p.add_argument(
        "--step-log-dir",
        default=None,
        metavar="DIR",
        help="log every engine step's shape and model time to DIR/<role>-<port>.jsonl "
        "(what `splitserve sim calibrate --from-steps` fits)",
    )


# The optional packages a command may need, by module, and the extra that installs each.
_EXTRA_MODULES = {
    **dict.fromkeys(("torch", "numba", "transformers", "gguf", "safetensors"), "engine"),
    **dict.fromkeys(("fastapi", "uvicorn", "prometheus_client", "tokenizers"), "router"),
    "matplotlib": "plots",
}


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
    add_server_tls_args(worker)
    add_worker_ca_arg(worker, "peer KV fetch (--kv-peer) verifies")
    add_max_body_arg(worker)
    add_access_log_args(worker)
    _add_engine_args(worker)
    add_kv_transfer_args(worker)
    add_kv_tier_args(worker)
    add_kv_events_args(worker)
    add_engine_choice(worker, worker=True)
    worker.set_defaults(func=cmd_worker)

    serve = sub.add_parser(
        "serve", help="start a deployment: one collocated worker, or P/D pools behind the router"
    )
    serve.add_argument("--prefill", type=int, default=0, metavar="N", help="prefill workers")
    serve.add_argument("--decode", type=int, default=0, metavar="M", help="decode workers")
    serve.add_argument("--threads-per-worker", type=int, default=None, metavar="T")
    serve.add_argument("--kv-transport", default="tcp", choices=["tcp", "shm"])
    serve.add_argument(
        "--kv-encrypt",
        action="store_true",
        help="encrypt the KV blocks that move between workers (AES-GCM; the transfers are "
        "always authenticated)",
    )
    add_placement_args(serve, prefill_policy=False)
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
    serve.add_argument(
        "--tls",
        action="store_true",
        help="HTTPS on every HTTP leg, with a private CA made for this run (its path is "
        "printed for clients to trust)",
    )
    _add_server_args(serve)
    add_access_log_args(serve)
    _add_engine_args(serve)
    add_kv_tier_args(serve)
    add_engine_choice(serve, worker=False)
    add_ray_serve_args(serve)
    serve.set_defaults(func=cmd_serve)

    keygen = sub.add_parser("keygen", help="write a new key for --kv-encryption-key-file")
    keygen.add_argument("path", help="where to write the key (refuses to overwrite)")
    keygen.set_defaults(func=cmd_keygen)
    add_kv_parser(sub)
    add_cluster_parser(sub)
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
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] not in _EXTRA_MODULES:
            raise
        extra = _EXTRA_MODULES[e.name.partition(".")[0]]
        print(
            f"splitserve {args.command}: error: needs {e.name}, which this install lacks: "
            f"pip install 'splitserve[{extra}]' (or make install)",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
