"""Validated configuration dataclasses. Unknown keys are errors, not silently ignored."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
# The engine's admission orders (``engine.scheduler``).
SCHEDULING_POLICIES = ("fcfs", "shortest-prefill")


def check_scheduling_policy(policy: str) -> None:
    """Raise ``ValueError`` unless ``policy`` is one of ``SCHEDULING_POLICIES``."""
    if policy not in SCHEDULING_POLICIES:
        known = ", ".join(SCHEDULING_POLICIES)
        raise ValueError(f"scheduling policy must be one of {known}, got {policy!r}")


@dataclass(slots=True)
class KVTierConfig:
    """The KV tier ladder below the device pool, and retention pins (see docs/kv-tiers.md).

    Tiers are off unless ``host_kv_gb > 0`` or ``disk_kv_dir`` is set; pins work either way.
    """

    host_kv_gb: float = 0.0
    disk_kv_dir: str | None = None
    disk_kv_gb: float = 10.0
    encryption_key_file: str | None = None
    host_kv_encrypt: bool = False  # seal the host tier's blocks too (needs the key file)
    write_through: bool = True  # also persist completed blocks to disk, not only evictions
    retention_ttl_s: float = 30.0  # pin TTL after a finish in tool calls, or kv_retention {}
    retention_max_ttl_s: float = 3600.0  # the most a request may ask for
    retention_quota: float = 0.25  # per session, fraction of the device pool
    retention_max_pinned: float = 0.5  # all sessions together, fraction of the device pool

    def __post_init__(self) -> None:
        for name in ("host_kv_gb", "disk_kv_gb", "retention_ttl_s", "retention_max_ttl_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        for name in ("retention_quota", "retention_max_pinned"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be a fraction in [0, 1], got {getattr(self, name)}")
        if self.host_kv_encrypt and (self.encryption_key_file is None or self.host_kv_gb <= 0):
            raise ValueError(
                "--host-kv-encrypt needs --host-kv-gb and --kv-encryption-key-file "
                "(splitserve keygen PATH writes one)"
            )
        if self.encryption_key_file is not None and not (self.disk_kv_dir or self.host_kv_encrypt):
            raise ValueError("an encryption key file needs a disk tier or --host-kv-encrypt")

    @property
    def enabled(self) -> bool:
        return self.host_kv_gb > 0 or self.disk_kv_dir is not None


@dataclass(slots=True)
class EngineConfig:
    """Everything one engine needs. ``model=None`` means the bundled default model."""

    model: str | None = None
    dtype: str = "auto"  # CPU: bfloat16 where native (models.loader.resolve_dtype), else float32
    device: str = "cpu"
    block_size: int = 16
    kv_cache_gb: float = 1.0
    # Allocate the KV cache in POSIX shared memory, so that decode workers on this host copy
    # blocks straight out of it (a prefill worker on the shm transport sets it).
    kv_cache_shm: bool = False
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    # Which waiting request starts next: "fcfs", or "shortest-prefill" (fewest tokens left to
    # compute after the prefix cache and KV tiers; see engine/scheduler.py).
    scheduling_policy: str = "fcfs"
    max_model_len: int | None = None  # default: the model's own limit, bounded by the KV pool
    threads: int | None = None
    # Split small decode steps' weight products across the threads (models.llama.SplitGemv):
    # ~10% faster at batch 1 on idle cores, far slower when other processes share them, so
    # off by default (benchmarks/engine_throughput.py, docs/benchmarks.md). No effect on packed
    # weights (models.llama.packed_weight), which keep every thread (docs/engine.md).
    split_gemv: bool = False
    # Run decode-only steps of up to 4 sequences through the fused numba kernel
    # (models/fused_decode.py) instead of the torch ops; falls back (with a log line) where numba
    # or the model does not allow it.
    fused_decode: bool = True
    seed: int = 0
    kv_tiers: KVTierConfig = field(default_factory=KVTierConfig)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        check_scheduling_policy(self.scheduling_policy)
        if not self.kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb!r}")
        if self.kv_cache_shm and self.device != "cpu":
            raise ValueError("kv_cache_shm needs device 'cpu' (the cache must be host memory)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**kwargs)
