"""The llama-family decoder and its loaders (GGUF, HF safetensors)."""

from __future__ import annotations

from splitserve.common.tokenizer import Tokenizer
from splitserve.models.config import ModelConfig
from splitserve.models.loader import LoadedModel, default_model_path, load_model, resolve_dtype

__all__ = [
    "LoadedModel",
    "ModelConfig",
    "Tokenizer",
    "default_model_path",
    "load_model",
    "resolve_dtype",
]
