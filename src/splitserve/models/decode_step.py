"""A whole decode step in one C++ call (``csrc/decode_step.cpp``) on CPU: float32, or bfloat16
where the CPU has AMX.

The model's torch path on packed weights runs a decode step as ~300 ops (each layer's norms,
three panel products, RoPE with the K/V writes, attention, activation, residual adds), each
with its own dispatch and output tensor; for a batch-1 step that overhead is about a third of
the time on two cores. This path calls the same C++ kernels in the same order from one op, so
a sequence's logits are bit for bit those of the torch path (alone or batched, at any thread
count), and only the overhead goes. It covers a step whose every sequence brings one new token,
on a model whose weight products are all on float32 panels (``models.panel_linear``) or all on
bfloat16 AMX tiles (``models.amx_linear``), with the fused ops built; ``unavailable_reason``
says why not otherwise.
"""

from __future__ import annotations

import numpy as np
import torch

from splitserve.models import native, paged_decode

ROPE_TABLE_MIN = 1024  # positions in the first RoPE tables
# The packed weights' dimensions the step takes, by dtype: float32 panels, bfloat16 AMX tiles.
PACKED_DIMS = {torch.float32: 3, torch.bfloat16: 4}


def unavailable_reason(model: torch.nn.Module) -> str | None:
    """Why this path cannot run ``model`` (its weights as they are packed now), or None."""
    for name in ("decode_step", "fused_ops", "paged_decode"):
        reason = native.load(name)
        if reason is not None:
            return f"the {name} kernel is off: {reason}"
    dtype = getattr(model, "dtype", None)
    if dtype not in PACKED_DIMS:
        return f"it runs float32 or bfloat16 weights, the model has {dtype}"
    packed = [getattr(m, "packed", None) for m in model.modules() if hasattr(m, "packed")]
    packed.append(model.lm_head_packed)
    if any(p is None or p.dim() != PACKED_DIMS[dtype] for p in packed):
        if dtype == torch.float32:
            return "not every weight product is on float32 panels (unpacked, or a width not 16k)"
        return "not every weight product is on AMX tiles (no AMX, or a width not 16k / 32k)"
    if model.config.head_dim % 32:
        return f"head_dim {model.config.head_dim} is not a multiple of 32 (the RoPE kernel's)"
    if not paged_decode.native_fits(model.config.num_heads, model.layers[0].self_attn.k_cache):
        return "the attention kernel does not take this model's heads or cache"
    return None


class DecodeStep:
    """The C++ step for one ``LlamaForCausalLM`` with packed weights, bound to its cache."""

    exact = True  # the torch path's bits, so any decode-only step may take it

    def __init__(self, model: torch.nn.Module) -> None:
        reason = unavailable_reason(model)
        if reason is not None:
            raise RuntimeError(f"native decode step unavailable: {reason}")
        cfg, empty = model.config, torch.empty(0)
        weights = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            weights += [
                layer.input_layernorm.weight,
                attn.qkv_proj.packed,
                empty if attn.qkv_proj.bias is None else attn.qkv_proj.bias,
                attn.o_proj.packed,
                empty if attn.o_proj.bias is None else attn.o_proj.bias,
                layer.post_attention_layernorm.weight,
                mlp.gate_up_proj.packed,
                mlp.down_proj.packed,
            ]
        self.model = model
        # RoPE tables of positions [0, P), grown as contexts grow (see rope_tables).
        self._cos = self._sin = torch.empty(0, cfg.head_dim, dtype=model.dtype)
        self.impl = torch.classes.splitserve.DecodeModel(
            [w.detach() for w in weights],
            model.embed_tokens.detach(),
            model.norm.weight.detach(),
            model.lm_head_packed,
            [cfg.num_heads, cfg.num_kv_heads, cfg.head_dim],
            float(cfg.rms_norm_eps),
            float(model.layers[0].self_attn.scale),
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        slots: np.ndarray,
        block_tables: np.ndarray,
        context_lens: np.ndarray,
        threads: int,
    ) -> torch.Tensor:
        """Float32 logits ``[n, vocab]`` (a bfloat16 model's widened) of ``n`` single-token
        sequences, each at position
        ``context_lens[r] - 1`` with its K/V written to ``slots[r]`` of the model's bound cache;
        ``block_tables`` ``[n, w]`` int64 covers every context. Runs on ``threads`` intra-op
        threads."""
        cos, sin = self.rope_tables(int(context_lens.max()))
        with native.intra_op_threads(threads):
            return self.impl.step(
                input_ids,
                cos,
                sin,
                torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)),
                torch.from_numpy(np.ascontiguousarray(block_tables, dtype=np.int64)),
                torch.from_numpy(np.ascontiguousarray(context_lens, dtype=np.int64)),
                self.model.kv_cache,
            )

    def rope_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and signed ``sin`` ``[P, head_dim]`` of positions ``[0, P)``, ``P >=
        length``: the model's ``Rotary`` run once over the range, whose rows are the ones it
        gives each position alone (tested), so the step indexes them instead of running it per
        step. Grown by doubling."""
        if self._cos.shape[0] < length:
            size = max(length, 2 * self._cos.shape[0], ROPE_TABLE_MIN)
            with torch.inference_mode():
                cos, sin = self.model.rotary(torch.arange(size), self.model.dtype)
            self._cos, self._sin = cos.view(size, -1), sin.view(size, -1)
        return self._cos, self._sin
