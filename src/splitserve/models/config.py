"""The shape of a llama-family model, read from an HF ``config.json`` or a GGUF header."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gguf import GGUFReader

# HF ``model_type`` values this engine's decoder implements, and what it calls each.
_HF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
# GGUF ``general.architecture`` values (llama.cpp writes Mistral as "llama").
_GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
_LLAMA3_ROPE_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


@dataclass(slots=True)
class ModelConfig:
    """Everything the decoder, the KV cache and the KV hash need to know about a model.

    ``rope_scaling`` is ``None`` (plain RoPE) or a dict with ``rope_type`` ``"llama3"``
    (keys ``factor, low_freq_factor, high_freq_factor, original_max_position_embeddings``)
    or ``"linear"`` (key ``factor``). ``attention_bias`` puts a bias on q/k/v (Qwen2);
    ``attention_out_bias`` also on the output projection (Llama with ``attention_bias``).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_out_bias: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    architecture: str = "llama"
    model_id: str = ""

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_heads ({self.num_heads}) is not a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        _check_rope_scaling(self.rope_scaling)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], model_id: str = "") -> ModelConfig:
        """Build from a parsed HF ``config.json`` (Llama, Mistral, Qwen2, SmolLM2)."""
        model_type = d.get("model_type")
        if model_type not in _HF_ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {model_type!r} in config.json; supported: "
                f"{sorted(_HF_ARCHITECTURES)}"
            )
        if d.get("mlp_bias"):
            raise ValueError("config.json sets mlp_bias, which this engine does not implement")
        _warn_sliding_window(d)
        num_heads = _require(d, "num_attention_heads")
        hidden = _require(d, "hidden_size")
        rope_theta, rope_scaling = _hf_rope(d)
        qwen2 = model_type == "qwen2"
        llama_bias = bool(d.get("attention_bias", False))
        return cls(
            vocab_size=_require(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_require(d, "intermediate_size"),
            num_layers=_require(d, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or hidden // num_heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and never an o bias; Llama's flag covers all four.
            attention_bias=qwen2 or llama_bias,
            attention_out_bias=not qwen2 and llama_bias,
            eos_token_ids=_as_id_list(d.get("eos_token_id")),
            bos_token_id=d.get("bos_token_id"),
            architecture=_HF_ARCHITECTURES[model_type],
            model_id=model_id,
        )

    @classmethod
    def from_gguf(cls, reader: GGUFReader, model_id: str = "") -> ModelConfig:
        """Build from a GGUF file's metadata and tensor table."""
        meta = _GgufMeta(reader)
        arch = meta.get("general.architecture")
        if arch not in _GGUF_ARCHITECTURES:
            raise ValueError(
                f"unsupported GGUF architecture {arch!r}; supported: {sorted(_GGUF_ARCHITECTURES)}"
            )
        tensors = {t.name: t for t in reader.tensors}
        if "rope_freqs.weight" in tensors:
            raise ValueError(
                "GGUF files with a rope_freqs tensor (llama3 rope scaling) are not "
                "supported yet; load the HF safetensors directory instead"
            )
        if "token_embd.weight" not in tensors:
            raise ValueError("GGUF file has no token_embd.weight tensor")
        hidden = meta.require(f"{arch}.embedding_length")
        num_heads = meta.require(f"{arch}.attention.head_count")
        # ggml shapes are fastest-moving first: token_embd is [hidden, vocab].
        vocab = int(tensors["token_embd.weight"].shape[-1])
        name = str(meta.get("general.name") or "")
        return cls(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=meta.require(f"{arch}.feed_forward_length"),
            num_layers=meta.require(f"{arch}.block_count"),
            num_heads=num_heads,
            num_kv_heads=meta.get(f"{arch}.attention.head_count_kv") or num_heads,
            head_dim=meta.get(f"{arch}.attention.key_length") or hidden // num_heads,
            rms_norm_eps=float(meta.require(f"{arch}.attention.layer_norm_rms_epsilon")),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base") or 10000.0),
            rope_scaling=_gguf_rope_scaling(meta, arch),
            max_position_embeddings=int(meta.get(f"{arch}.context_length") or 2048),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            attention_out_bias="blk.0.attn_output.bias" in tensors,
            eos_token_ids=_as_id_list(meta.get("tokenizer.ggml.eos_token_id")),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            architecture="mistral" if arch == "llama" and "mistral" in name.lower() else arch,
            model_id=model_id,
        )


class _GgufMeta:
    """Scalar metadata of a GGUF reader, read on demand (the big token arrays never are)."""

    def __init__(self, reader: GGUFReader) -> None:
        self._fields = reader.fields

    def get(self, key: str) -> Any:
        f = self._fields.get(key)
        return None if f is None else f.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"GGUF file lacks required metadata key {key!r}")
        return value


def _gguf_rope_scaling(meta: _GgufMeta, arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta.require(f"{arch}.rope.scaling.factor"))}
    raise ValueError(f"unsupported GGUF rope scaling type {kind!r}")


def _hf_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either transformers-5 ``rope_parameters`` or the older
    top-level ``rope_theta`` + ``rope_scaling``."""
    params = dict(d.get("rope_parameters") or {})
    legacy = d.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    kind = params.pop("rope_type", params.pop("type", "default"))
    if kind == "default":
        return theta, None
    return theta, {"rope_type": kind, **params}


def _check_rope_scaling(scaling: dict[str, Any] | None) -> None:
    if scaling is None:
        return
    kind = scaling.get("rope_type")
    needed = {"llama3": _LLAMA3_ROPE_KEYS, "linear": ("factor",)}.get(kind)
    if needed is None:
        raise ValueError(f"unsupported rope scaling type {kind!r}; supported: llama3, linear")
    missing = [k for k in needed if k not in scaling]
    if missing:
        raise ValueError(f"{kind} rope scaling lacks {missing}")


def _warn_sliding_window(d: dict[str, Any]) -> None:
    window = d.get("sliding_window")
    uses = d.get("use_sliding_window", d.get("model_type") == "mistral")
    if uses and window and window < d.get("max_position_embeddings", 0):
        warnings.warn(
            f"sliding_window={window} is not implemented: attention stays full; "
            "outputs past that context length differ from the reference",
            stacklevel=3,
        )


def _require(d: dict[str, Any], key: str) -> Any:
    if d.get(key) is None:
        raise ValueError(f"config.json lacks required key {key!r}")
    return d[key]


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]
