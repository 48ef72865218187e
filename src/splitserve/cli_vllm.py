"""The ``--engine`` flags of ``splitserve worker`` and ``serve``, and what ``vllm`` makes of
the other flags: those vLLM has an equivalent for pass on, splitserve-only ones are refused
with a clear message rather than silently ignored. A vLLM worker with ``--role prefill`` or
``decode`` belongs to a P/D deployment and moves KV with vLLM's NixlConnector; ``--role
both`` runs whole requests, with no connector."""

from __future__ import annotations

import argparse
import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.cluster.vllm_worker import NixlSide

ENGINES = ("builtin", "vllm")

# Flags that only the builtin engine implements: (argparse dest, flag, value when unset).
_BUILTIN_ONLY = (
    ("split_gemv", "--split-gemv", False),
    ("scheduling_policy", "--scheduling-policy", "fcfs"),
    ("host_kv_gb", "--host-kv-gb", 0.0),
    ("disk_kv_dir", "--disk-kv-dir", None),
    ("kv_encryption_key_file", "--kv-encryption-key-file", None),
    ("host_kv_encrypt", "--host-kv-encrypt", False),
    ("step_log_dir", "--step-log-dir", None),
    ("max_waiting", "--max-waiting", None),
    ("kv_peer", "--kv-peer", False),
    ("kv_peer_fetch", "--kv-peer-fetch", False),
    ("kv_transport", "--kv-transport", "tcp"),
    ("kv_encrypt", "--kv-encrypt", False),
    ("kv_shm_checksums", "--kv-shm-checksums", False),
    ("kv_secret_file", "--kv-secret-file", None),
    ("kv_lease_ttl", "--kv-lease-ttl", 30.0),
    ("kv_test_fault", "--kv-test-fault", None),
)


def add_engine_choice(p: argparse.ArgumentParser, worker: bool) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--engine",
        default="builtin",
        choices=ENGINES,
        help="builtin: splitserve's own engine; vllm: a real vLLM server per worker, "
        "from .venv-vllm (make install-vllm)",
    )
    g.add_argument(
        "--vllm-python",
        default=None,
        metavar="PATH",
        help="the Python of a virtualenv with vLLM (default: the repository's .venv-vllm)",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="--engine vllm: serve these LoRA adapters (PEFT directories); a request naming "
        "NAME as its model runs with that adapter",
    )
    if worker:
        g.add_argument(
            "--cpus",
            default=None,
            metavar="IDS",
            help="run the worker on these cores, e.g. 0 or 0-1 (default --threads: one per "
            "core). Default: builtin, every core; vllm, --threads cores from 0, else vLLM's own",
        )


_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM accepts


def lora_args(args: argparse.Namespace) -> list[str]:
    """vLLM's flags for ``--lora-modules NAME=PATH ...``, with the smallest maximum rank
    that fits every adapter; ValueError for a builtin worker or a bad adapter."""
    modules = getattr(args, "lora_modules", [])
    if not modules:
        return []
    if args.engine != "vllm":
        raise ValueError("--lora-modules needs --engine vllm: the builtin engine runs no LoRA")
    ranks = []
    for module in modules:
        name, sep, path = module.partition("=")
        if not (sep and name and path):
            raise ValueError(f"--lora-modules wants NAME=PATH, got {module!r}")
        try:
            with open(os.path.join(path, "adapter_config.json")) as f:
                ranks.append(int(json.load(f)["r"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--lora-modules {name}: {path} is no PEFT LoRA adapter ({e})") from e
    fits = [r for r in _LORA_RANKS if r >= max(ranks)]
    if not fits:
        raise ValueError(f"--lora-modules: rank {max(ranks)} is above vLLM's {_LORA_RANKS[-1]}")
    out = ["--enable-lora", "--max-lora-rank", str(fits[0])]
    return out + ["--max-loras", str(len(modules)), "--lora-modules", *modules]


def check_vllm_flags(args: argparse.Namespace) -> None:
    """Refuse builtin-only flags with ``--engine vllm``: a clear error, not a silent no-op."""
    for dest, flag, unset in _BUILTIN_ONLY:
        if getattr(args, dest, unset) != unset:
            raise ValueError(f"{flag} is a builtin-engine option; --engine vllm has no equivalent")
    if not getattr(args, "fused_decode", True):
        raise ValueError("--no-fused-decode is a builtin-engine option")


def cpus_of(args: argparse.Namespace) -> str | None:
    """The cores a vLLM worker binds to: ``--cpus``, else ``--threads`` cores from 0."""
    if args.cpus is not None:
        return args.cpus
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        return "0" if args.threads == 1 else f"0-{args.threads - 1}"
    return None


def run_vllm_worker_from_args(args: argparse.Namespace) -> int:
    from splitserve.cluster.vllm_worker import VllmWorkerSpec, run_vllm_worker, served_name
    from splitserve.models.hf_export import hf_model_dir
    from splitserve.models.loader import default_model_path

    check_vllm_flags(args)
    model = args.model or default_model_path()
    spec = VllmWorkerSpec(
        model_dir=hf_model_dir(model),
        served_model_name=args.served_model_name or served_name(model),
        host=args.host,
        port=args.port,
        dtype=args.dtype,
        kv_cache_gb=args.kv_cache_gb,
        cpus=cpus_of(args),
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        api_key=args.api_key or os.environ.get("SPLITSERVE_API_KEY") or None,
        log_level="warning" if args.log_level in ("info", "debug") else args.log_level,
        extra_args=[
            *kv_events_args(args.kv_events_endpoint, args.kv_events_replay_endpoint),
            *lora_args(args),
        ],
        nixl=nixl_side(args),
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        ca=args.worker_ca,
    )
    return run_vllm_worker(spec, args.vllm_python)


def nixl_side(args: argparse.Namespace) -> NixlSide | None:
    """A P/D worker's NixlConnector side channel: ``--kv-host`` (default ``--host``) and
    ``--kv-port`` (default: a free port); None for ``--role both``."""
    from splitserve.cluster.local import free_port
    from splitserve.cluster.vllm_worker import NixlSide

    if args.role == "both":
        return None
    host = args.kv_host or args.host
    port = args.kv_port or free_port(host)
    return NixlSide(host, port, failure_policy=args.kv_load_failure_policy)


def kv_events_args(endpoint: str | None, replay: str | None = None) -> list[str]:
    """vLLM's flags for our ``--kv-events-endpoint tcp://HOST:PORT``: it publishes on PORT
    (and answers replays on ``--kv-events-replay-endpoint``'s port)."""
    if endpoint is None:
        return []
    from splitserve.common.kv_events import vllm_kv_events_config

    def port_of(flag: str, value: str) -> int:
        scheme, _, port = value.rpartition(":")
        if not scheme.startswith("tcp://") or not port.isdigit():
            raise ValueError(f"{flag} wants tcp://HOST:PORT, got {value!r}")
        return int(port)

    port = port_of("--kv-events-endpoint", endpoint)
    replay_port = None if replay is None else port_of("--kv-events-replay-endpoint", replay)
    return ["--kv-events-config", vllm_kv_events_config(port, replay_port=replay_port)]


def serve_vllm_args(args: argparse.Namespace) -> list[str]:
    """The flags ``serve --engine vllm`` passes to each worker it starts (cores come apart)."""
    check_vllm_flags(args)
    out = ["--engine", "vllm", "--dtype", args.dtype, "--kv-cache-gb", str(args.kv_cache_gb)]
    if args.vllm_python:
        out += ["--vllm-python", args.vllm_python]
    if args.lora_modules:  # checked once by ``cmd_serve``, before any worker starts
        out += ["--lora-modules", *args.lora_modules]
    for flag, value in (
        ("--threads", args.threads),
        ("--max-model-len", args.max_model_len),
        ("--max-num-seqs", args.max_num_seqs),
        ("--max-num-batched-tokens", args.max_num_batched_tokens),
    ):
        if value is not None:
            out += [flag, str(value)]
    return out
