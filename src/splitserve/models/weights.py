"""Copying HF-named checkpoint tensors into the decoder's (partly fused) parameters."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

import torch

from splitserve.models.config import ModelConfig


class Decoder(Protocol):
    """The model the weights go into (``llama.LlamaForCausalLM``, which calls the loader)."""

    config: ModelConfig

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...


# HF module suffix -> (our fused module suffix, shard index within it)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_RENAMED = {"embed_tokens.weight": "embed_tokens", "lm_head.weight": "lm_head_t"}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightLoader:
    """Fills every parameter of a decoder exactly once from HF-named tensors."""

    def __init__(self, model: Decoder) -> None:
        cfg = model.config
        self.params = dict(model.named_parameters())
        self.tied = cfg.tie_word_embeddings
        q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        self.shard_rows = {
            "self_attn.qkv_proj": [(0, q), (q, kv), (q + kv, kv)],
            "mlp.gate_up_proj": [(0, inter), (inter, inter)],
        }
        self.pending = self._all_targets()
        if self.tied:  # filled from the embedding after loading
            self.pending.discard(("lm_head_t", None))

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            self._load_one(name, tensor)
        if self.pending:
            missing = sorted(f"{p}[shard {s}]" if s is not None else p for p, s in self.pending)
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:5]}")

    def _all_targets(self) -> set[tuple[str, int | None]]:
        targets: set[tuple[str, int | None]] = set()
        for name in self.params:
            module = name.rsplit(".", 1)[0]
            suffix = module.split(".", 2)[-1] if module.startswith("layers.") else ""
            shards = self.shard_rows.get(suffix)
            if shards is None:
                targets.add((name, None))
            else:
                targets.update((name, i) for i in range(len(shards)))
        return targets

    def _load_one(self, hf_name: str, tensor: torch.Tensor) -> None:
        name = hf_name.removeprefix("model.")
        if name.endswith(_IGNORED_SUFFIXES) or (self.tied and name == "lm_head.weight"):
            return
        name = _RENAMED.get(name, name)
        target, shard = self._fused_target(name)
        param = self.params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {hf_name!r} matches no model parameter")
        dest = param.data
        if target == "lm_head_t":  # stored transposed, see LlamaForCausalLM
            tensor = tensor.t()
        if shard is not None:
            start, rows = self.shard_rows[target.split(".", 2)[-1].rsplit(".", 1)[0]][shard]
            dest = dest[start : start + rows]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(
                f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        self.pending.discard((target, shard))

    def _fused_target(self, name: str) -> tuple[str, int | None]:
        """``layers.3.self_attn.k_proj.bias`` -> (``layers.3.self_attn.qkv_proj.bias``, 1)."""
        if not name.startswith("layers."):
            return name, None
        _, index, rest = name.split(".", 2)
        module, kind = rest.rsplit(".", 1)
        fused = _FUSED.get(module)
        if fused is None:
            return name, None
        return f"layers.{index}.{fused[0]}.{kind}", fused[1]
