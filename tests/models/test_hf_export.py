"""The bundled GGUF as an HF directory (what ``--engine vllm`` loads): our own HF loader reads
it back to the same model, and a second export reuses the first."""

from __future__ import annotations

import json
import os

import pytest

from splitserve.models.config import ModelConfig
from splitserve.models.hf_export import hf_config, hf_model_dir
from splitserve.models.loader import default_model_path, load_model


def test_the_bundled_gguf_exports_to_a_directory_that_loads_to_the_same_model(default_model):
    path = hf_model_dir(default_model_path())
    assert hf_model_dir(default_model_path()) == path  # converted once, then reused
    names = set(os.listdir(path))
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= names
    config = json.loads(open(os.path.join(path, "config.json")).read())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["rope_theta"] == 1e5
    exported = load_model(path)
    want = {k: v for k, v in vars_of(default_model.config).items() if k != "model_id"}
    got = {k: v for k, v in vars_of(exported.config).items() if k != "model_id"}
    assert got == want
    for (name, a), (_, b) in zip(
        default_model.model.state_dict().items(), exported.model.state_dict().items(), strict=True
    ):
        assert a.equal(b), name
    messages = [{"role": "user", "content": "Name a prime."}]
    assert exported.tokenizer.encode(exported.tokenizer.chat_prompt(messages)) == (
        default_model.tokenizer.encode(default_model.tokenizer.chat_prompt(messages))
    )


def vars_of(config: ModelConfig) -> dict:
    return {name: getattr(config, name) for name in config.__slots__}


def test_hf_config_round_trips_through_our_reader():
    config = ModelConfig(64, 32, 48, 2, 4, 2, 8, rope_theta=5e5, eos_token_ids=[3, 4])
    back = ModelConfig.from_hf_dict(hf_config(config))
    assert back == config
    qwen = ModelConfig(64, 32, 48, 2, 4, 2, 8, attention_bias=True, architecture="qwen2")
    assert hf_config(qwen)["architectures"] == ["Qwen2ForCausalLM"]
    assert ModelConfig.from_hf_dict(hf_config(qwen)) == qwen


def test_what_is_not_a_model_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="neither a .gguf file nor an HF model directory"):
        hf_model_dir(str(tmp_path / "missing.gguf"))
