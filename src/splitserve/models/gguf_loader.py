"""Reading a llama-family GGUF file: its config and its tensors, dequantized, under HF names."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize

from splitserve.models.config import ModelConfig

# Types whose numpy dequantization in the gguf package we rely on; the first five are
# checked against our own reference in tests/models/test_loader.py.
SUPPORTED_TYPES = frozenset(
    {Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.BF16, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K}
)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp permutes q/k rows for its interleaved RoPE only for these architectures
# (Qwen2 uses the NeoX layout, which is HF's already).
_PERMUTED_ARCHS = ("llama", "mistral")


def open_gguf(path: str) -> GGUFReader:
    """A reader for ``path``, or ``ValueError`` if it is not a readable GGUF file."""
    try:
        return GGUFReader(path)
    except (OSError, ValueError, IndexError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def read_config(reader: GGUFReader, model_id: str) -> ModelConfig:
    return ModelConfig.from_gguf(reader, model_id=model_id)


def dequantize_tensor(tensor: ReaderTensor) -> np.ndarray:
    """The tensor as float32 in torch order (rows = ggml's slowest dimension)."""
    kind = Q(tensor.tensor_type)
    if kind not in SUPPORTED_TYPES:
        names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise ValueError(
            f"GGUF tensor {tensor.name!r} has type {kind.name}, which is not "
            f"supported; supported types: {names}"
        )
    values = dequantize(tensor.data, kind)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    # F32 data is a read-only view of the memory map; torch wants a writable array.
    copy = True if not values.flags.writeable else None
    return np.array(values, dtype=np.float32, copy=copy, order="C").reshape(shape)


def gguf_weights(reader: GGUFReader, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, float32 tensor)`` for every tensor, q/k rows restored to HF's order."""
    arch = reader.fields["general.architecture"].contents()
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        values = torch.from_numpy(dequantize_tensor(tensor))
        if arch in _PERMUTED_ARCHS and (".q_proj." in name or ".k_proj." in name):
            heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
            values = unpermute_rope_rows(values, heads)
        yield name, values


def hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        raise ValueError(f"unexpected tensor {gguf_name!r} in GGUF file")
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` of q/k rows: within each head it interleaves the two
    rotary halves (row pairs ``(i, i + hd/2)`` become adjacent); HF's rotate_half wants them
    split again. Same as transformers' GGUF loader ``_reverse_permute_weights``."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
