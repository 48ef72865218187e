"""Model profiles: the architecture numbers a roofline needs, from each model's config.json.

Parameter counts are derived from the shapes (and checked against the published totals in
the tests), so a profile is exactly what its source file says and nothing estimated.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


@dataclass(frozen=True, slots=True)
class ModelProfile:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width (0 when every layer is MoE)
    vocab: int
    experts: int = 0  # routed experts per MoE layer (0: dense)
    experts_per_token: int = 0
    moe_intermediate: int = 0
    tied_embeddings: bool = False
    max_context: int = 131072
    source: str = ""

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def attention_params(self) -> int:
        """Per layer: Q and O projections over all heads, K and V over the KV heads."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return 2 * self.hidden * q + 2 * self.hidden * kv

    @property
    def expert_params(self) -> int:
        """One expert's gate, up and down projections (SwiGLU)."""
        return 3 * self.hidden * self.moe_intermediate

    @property
    def mlp_params(self) -> int:
        """Per layer, all of it: the dense MLP, or every expert plus the router."""
        if self.is_moe:
            return self.experts * self.expert_params + self.hidden * self.experts
        return 3 * self.hidden * self.intermediate

    @property
    def active_mlp_params(self) -> int:
        """Per layer, what one token multiplies through."""
        if self.is_moe:
            return self.experts_per_token * self.expert_params + self.hidden * self.experts
        return self.mlp_params

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def total_params(self) -> int:
        return self.layers * (self.attention_params + self.mlp_params) + self.embedding_params

    @property
    def active_params(self) -> int:
        return self.layers * (self.attention_params + self.active_mlp_params) + (
            self.embedding_params
        )

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        """K and V of every layer for one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[kv_dtype]


MODELS: dict[str, ModelProfile] = {
    p.name: p
    for p in (
        ModelProfile(
            name="llama3-8b",
            layers=32,
            hidden=4096,
            heads=32,
            kv_heads=8,
            head_dim=128,
            intermediate=14336,
            vocab=128256,
            max_context=8192,
            source="meta-llama/Meta-Llama-3-8B config.json (8.03B parameters)",
        ),
        ModelProfile(
            name="llama3-70b",
            layers=80,
            hidden=8192,
            heads=64,
            kv_heads=8,
            head_dim=128,
            intermediate=28672,
            vocab=128256,
            max_context=8192,
            source="meta-llama/Meta-Llama-3-70B config.json (70.6B parameters)",
        ),
        ModelProfile(
            name="qwen3-235b-a22b",
            layers=94,
            hidden=4096,
            heads=64,
            kv_heads=4,
            head_dim=128,
            intermediate=0,
            vocab=151936,
            experts=128,
            experts_per_token=8,
            moe_intermediate=1536,
            max_context=40960,
            source="Qwen/Qwen3-235B-A22B config.json (235B total, 22B activated parameters)",
        ),
        ModelProfile(
            name="smollm2-135m",
            layers=30,
            hidden=576,
            heads=9,
            kv_heads=3,
            head_dim=64,
            intermediate=1536,
            vocab=49152,
            tied_embeddings=True,
            max_context=8192,
            source="HuggingFaceTB/SmolLM2-135M-Instruct config.json (134.5M parameters)",
        ),
    )
}


def get_model(name: str) -> ModelProfile:
    try:
        return MODELS[name]
    except KeyError:
        known = ", ".join(sorted(MODELS))
        raise ValueError(f"unknown model {name!r}; choose from {known}") from None
