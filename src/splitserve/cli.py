"""The ``splitserve`` command."""

from __future__ import annotations

import argparse
import os
import sys

from splitserve.common.sampling_params import SamplingParams


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF model directory (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None, help="CPU threads for the model")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV cache pool size")
    p.add_argument("--max-model-len", type=int, default=None)


def _engine_options(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype,
        threads=args.threads,
        kv_cache_gb=args.kv_cache_gb,
        max_model_len=args.max_model_len,
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

    config = EngineConfig.from_kwargs(model=args.model, **_engine_options(args))
    run_worker(
        config,
        role=args.role,
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get("SPLITSERVE_API_KEY") or None,
        max_waiting=args.max_waiting,
        served_model_name=args.served_model_name,
        log_level=args.log_level,
    )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from splitserve.cluster.local import serve

    worker_args = ["--dtype", args.dtype, "--kv-cache-gb", str(args.kv_cache_gb)]
    for flag, value in (("--threads", args.threads), ("--max-model-len", args.max_model_len),
                        ("--max-waiting", args.max_waiting)):
        if value is not None:
            worker_args += [flag, str(value)]
    return serve(
        host=args.host,
        port=args.port,
        model=args.model,
        worker_args=worker_args,
        api_key=args.api_key or os.environ.get("SPLITSERVE_API_KEY") or None,
        ready_timeout=args.ready_timeout,
    )


def _add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $SPLITSERVE_API_KEY)")
    p.add_argument("--max-waiting", type=int, default=None,
                   help="answer 429 when this many requests are already waiting")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a reply offline and print it")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    _add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    worker = sub.add_parser("worker", help="serve one engine over the OpenAI HTTP API")
    worker.add_argument("--role", default="both", choices=["both", "prefill", "decode"])
    worker.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: the model's id)")
    worker.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])
    _add_server_args(worker)
    _add_engine_args(worker)
    worker.set_defaults(func=cmd_worker)

    serve = sub.add_parser("serve", help="start a deployment (for now: one collocated worker)")
    serve.add_argument("--ready-timeout", type=float, default=600.0,
                       help="seconds to wait for the workers to load their model")
    _add_server_args(serve)
    _add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)
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
