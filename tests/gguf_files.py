"""Small GGUF files written like llama.cpp's converter (``convert_hf_to_gguf.py``) writes
them, from random-weight transformers models: for the loader's tests."""

from __future__ import annotations

import gguf
import numpy as np


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_gguf_model(hf, arch: str, path) -> None:
    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch}")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_eos_token_id(2)
    for name, tensor in hf.state_dict().items():
        writer.add_tensor(_gguf_name(name), _gguf_data(name, tensor.numpy(), cfg, arch))
    finish(writer)


def _gguf_name(hf_name: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, index, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{index}.{_GGUF_NAMES[module]}.{kind}"


def _gguf_data(name: str, w: np.ndarray, cfg, arch: str) -> np.ndarray:
    if arch == "llama" and ".q_proj." in name:
        return llama_cpp_permute(w, cfg.num_attention_heads)
    if arch == "llama" and ".k_proj." in name:
        return llama_cpp_permute(w, cfg.num_key_value_heads)
    return w


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
