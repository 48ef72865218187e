"""Random-weight LoRA adapters in PEFT's layout, for tests that serve one with vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_lora_adapter(
    directory: Path, model_dir: str, rank: int = 8, seed: int = 0, scale: float = 0.05
) -> Path:
    """A LoRA adapter on ``q_proj`` and ``v_proj`` of the HF model in ``model_dir``."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    outputs = {"q_proj": hidden, "v_proj": config["num_key_value_heads"] * head_dim}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module, out in outputs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            for part, shape in (("lora_A", (rank, hidden)), ("lora_B", (out, rank))):
                weight = torch.randn(shape, generator=generator) * scale
                tensors[f"{prefix}.{part}.weight"] = weight.contiguous()
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    peft = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(outputs),
        "bias": "none",
        "fan_in_fan_out": False,
        "base_model_name_or_path": model_dir,
    }
    (directory / "adapter_config.json").write_text(json.dumps(peft))
    return directory
