"""The router's configuration: validated at construction, unknown keys are errors."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from splitserve.common.body_limit import DEFAULT_MAX_BODY_BYTES
from splitserve.common.tls import client_context
from splitserve.router.policies import POLICIES
from splitserve.router.ring import DEFAULT_LOAD_FACTOR, DEFAULT_LOAD_FLOOR, DEFAULT_VNODES
from splitserve.router.worker import Worker, check_url, normalize_url

# Below this many uncached prompt tokens the decode worker prefills locally: a remote leg
# costs a second HTTP round trip plus the transfer. Measured break-even on this project's
# machine: ~30 tokens (benchmarks/disagg_latency.py, docs/benchmarks.md); 64 leaves room
# for the error of the router's characters-per-token estimate.
DEFAULT_REMOTE_PREFILL_THRESHOLD = 64
WORKER_ENGINES = ("builtin", "vllm")


@dataclass(slots=True)
class RouterConfig:
    """Everything ``create_app`` needs.

    ``workers`` are collocated (role ``both``); ``decode`` and ``prefill`` form the
    disaggregated pools. ``api_key`` guards the OpenAI endpoints (``api_keys_file``: one
    tenant per key, see ``common/tenants.py``), ``admin_key`` (default: ``api_key``) the
    membership endpoints, and ``worker_api_key`` is what the router sends to the workers
    (default: the client's own ``Authorization`` header is forwarded). With the
    ``cluster_secret`` the router signs every request to a worker with its tenant.
    ``worker_ca``: the CA certificate file ``https://`` workers are verified against (default:
    the system's trust store).
    """

    decode: list[str] = field(default_factory=list)
    prefill: list[str] = field(default_factory=list)
    workers: list[str] = field(default_factory=list)
    policy: str = "session"
    prefill_policy: str = "prefix"
    load_factor: float = DEFAULT_LOAD_FACTOR
    load_floor: int = DEFAULT_LOAD_FLOOR
    vnodes: int = DEFAULT_VNODES
    api_key: str | None = None
    admin_key: str | None = None
    worker_api_key: str | None = None
    api_keys_file: str | None = None
    cluster_secret: bytes = field(default=b"", repr=False)
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    failure_threshold: int = 3
    cooldown_s: float = 5.0
    max_retries: int = 2  # further workers tried after the first fails before its first byte
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 600.0
    max_connections: int = 1024
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # a larger request body is a 413
    access_log: str | None = None  # a JSON line per OpenAI request (common.access_log)
    access_log_max_bytes: int = 100 * 2**20  # rotated at this size
    # Below the workers' keep-alive timeout (uvicorn's default: 5 s), so the router retires an
    # idle connection before the worker may close it under a request being sent on it.
    keepalive_expiry_s: float = 2.0
    # Conditional disaggregation: a remote prefill only when the uncached part of the prompt
    # (estimated at chars_per_token, since the router does not tokenize) reaches the threshold.
    disaggregate: bool = False  # `splitserve serve --prefill N` turns it on
    remote_prefill_threshold: int = DEFAULT_REMOTE_PREFILL_THRESHOLD
    chars_per_token: float = 4.0
    prefix_chars: int = 512
    # Tell a session's decode worker its next turn is coming (POST /v1/kv/prefetch) so it
    # starts promoting the session's KV from host RAM or disk while the request is routed.
    prefetch_hints: bool = False
    # Peer KV fetch: a session turn placed off its (healthy) home worker names the home in
    # the body (``kv_peer``), and the chosen worker pulls the session's KV from there.
    kv_peer_fetch: bool = False
    # The kv-events policy: worker URL -> the ZMQ endpoint of its KV events (vLLM's format),
    # and the model directory whose tokenizer and chat template give the prompt's token ids.
    kv_events: dict[str, str] = field(default_factory=dict)
    kv_events_topic: str = ""
    tokenizer: str | None = None
    worker_ca: str | None = None
    # "vllm": the workers are vLLM servers, which know no tenants; the router then sends each
    # request's KV salt as vLLM's own ``cache_salt`` so tenants never share vLLM's cache.
    worker_engine: str = "builtin"

    def __post_init__(self) -> None:
        for name in ("policy", "prefill_policy"):
            if getattr(self, name) not in POLICIES:
                known = ", ".join(sorted(POLICIES))
                raise ValueError(f"{name} must be one of {known}, got {getattr(self, name)!r}")
        if self.load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1, got {self.load_factor}")
        positive = (
            "vnodes",
            "load_floor",
            "failure_threshold",
            "prefix_chars",
            "max_connections",
            "max_body_bytes",
            "access_log_max_bytes",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_retries", "remote_prefill_threshold", "cooldown_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in (
            "health_interval_s",
            "health_timeout_s",
            "connect_timeout_s",
            "read_timeout_s",
            "keepalive_expiry_s",
            "chars_per_token",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.worker_engine not in WORKER_ENGINES:
            raise ValueError(
                f"worker_engine must be one of {', '.join(WORKER_ENGINES)}, "
                f"got {self.worker_engine!r}"
            )
        if self.worker_ca is not None:
            client_context(self.worker_ca)  # a missing or bad file fails here, not per request
        if self.admin_key is None:
            self.admin_key = self.api_key
        self.kv_events = {normalize_url(u): e for u, e in self.kv_events.items()}
        if "kv-events" in (self.policy, self.prefill_policy) and not (
            self.kv_events and self.tokenizer
        ):
            raise ValueError(
                "the kv-events policy needs the workers' event endpoints (kv_events) "
                "and a tokenizer directory (tokenizer)"
            )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> RouterConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown router option(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def initial_workers(self) -> list[Worker]:
        """The command line's workers; a URL listed in two pools is an error."""
        out: dict[str, Worker] = {}
        for role, urls in (
            ("both", self.workers),
            ("decode", self.decode),
            ("prefill", self.prefill),
        ):
            for url in urls:
                w = Worker(check_url(normalize_url(url)), role)
                if w.url in out:
                    raise ValueError(f"worker {w.url} is listed twice")
                out[w.url] = w
        return list(out.values())
