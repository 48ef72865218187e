"""Small random-weight transformers models saved to disk, to check our decoder against."""

from __future__ import annotations

import pytest
import torch

BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.1,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 500000.0,
}
VARIANTS = {
    "llama": ("llama", {}),
    "llama3_tied": ("llama", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True}),
    "qwen2": ("qwen2", {"tie_word_embeddings": False}),
}


@pytest.fixture(scope="session")
def hf_model_factory():
    """``make(variant, seed=0) -> transformers model``; variants: llama, llama3_tied, qwen2."""
    return make_hf_model


def make_hf_model(variant: str, seed: int = 0, **overrides):
    """A random transformers model of ``variant`` (config fields in ``overrides`` replaced), in
    float32 eval mode. Norm weights and biases are randomised too (HF initialises them to 1
    and 0, which would hide bugs)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kind, extra = VARIANTS[variant]
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**{**BASE, **extra, **overrides}))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**{**BASE, **extra, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    return model.float().eval()
