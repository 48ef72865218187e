"""Validated configuration dataclasses. Unknown keys are errors, not silently ignored."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(slots=True)
class EngineConfig:
    """Everything one engine needs. ``model=None`` means the bundled default model."""

    model: str | None = None
    dtype: str = "auto"  # float32 on CPU, float16 on CUDA
    device: str = "cpu"
    block_size: int = 16
    kv_cache_gb: float = 1.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None  # default: the model's own limit, bounded by the KV pool
    threads: int | None = None
    seed: int = 0

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
        if not self.kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb!r}")
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
