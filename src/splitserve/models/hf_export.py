"""A model as an HF directory that another engine (vLLM) loads: GGUF files converted once.

An HF directory passes through unchanged. A GGUF file goes through the converted-model
cache (``gguf_cache``) and then gets a sibling entry shaped like a Hugging Face checkpoint::

    <cache>/hf-v1-<xxh3-128 of the file>/
        config.json               HF ``LlamaConfig``-style (model_type, architectures, ...)
        generation_config.json    bos/eos, so the other engine stops where ours does
        model.safetensors         a hard link to the GGUF entry's float32 weights (or a copy)
        tokenizer.json, tokenizer_config.json, chat_template.jinja

Like the GGUF entry it appears whole or not at all (written aside, renamed into place).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from splitserve.common.tokenizer import Tokenizer
from splitserve.models import gguf_cache, gguf_loader
from splitserve.models.config import ModelConfig

FORMAT = "hf-v1"
_HF_CLASSES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
}


def hf_model_dir(path: str) -> str:
    """An HF directory holding the model at ``path`` (a ``.gguf`` file or an HF directory).

    Raises ``ValueError`` for anything else, or when the model cache is off
    (``SPLITSERVE_MODEL_CACHE=off``), since the conversion has nowhere to live.
    """
    if os.path.isdir(path):
        return path
    if not (path.endswith(".gguf") and os.path.isfile(path)):
        raise ValueError(f"{path} is neither a .gguf file nor an HF model directory")
    root = gguf_cache.cache_dir()
    if root is None:
        raise ValueError(
            f"converting a GGUF for another engine needs the model cache: unset "
            f"{gguf_cache.ENV_VAR}"
        )
    digest = gguf_cache.file_digest(path)
    target = root / f"{FORMAT}-{digest}"
    if not (target / "config.json").is_file():
        _write(target, _gguf_entry(path, root, digest))
    return str(target)


def hf_config(config: ModelConfig) -> dict[str, Any]:
    """``config`` in the shape of an HF ``config.json``."""
    model_type, architecture = _HF_CLASSES[config.architecture]
    eos = config.eos_token_ids
    out: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "torch_dtype": "float32",
    }
    if config.architecture == "llama":
        out["attention_bias"] = config.attention_bias
        out["mlp_bias"] = False
    return out


def _gguf_entry(path: str, root: Path, digest: str) -> gguf_cache.Entry:
    """The GGUF file's cache entry, converted now if the cache does not hold it yet."""
    entry = gguf_cache.Entry(root, digest)
    if entry.exists() and entry.has_tokenizer():
        return entry
    reader = gguf_loader.open_gguf(path)
    config = gguf_loader.read_config(reader, os.path.basename(path))
    weights = dict(gguf_loader.gguf_weights(reader, config))
    tokenizer = Tokenizer.from_gguf(path, config.eos_token_ids)
    if not config.eos_token_ids:
        config.eos_token_ids = list(tokenizer.eos_token_ids)
    entry.remove()
    entry.write(config, weights, tokenizer)
    if not entry.exists():
        raise ValueError(f"could not write the converted model under {root}")
    return entry


def _write(target: Path, entry: gguf_cache.Entry) -> None:
    config = entry.read_config("")
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(hf_config(config), indent=1))
        generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_ids}
        (tmp / "generation_config.json").write_text(json.dumps(generation))
        _link_or_copy(entry.path / "model.safetensors", tmp / "model.safetensors")
        for made in Path(entry.tokenizer_dir).iterdir():
            shutil.copy(made, tmp / made.name)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not lost to a concurrent writer
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy(src, dst)
