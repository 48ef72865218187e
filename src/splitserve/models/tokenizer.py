"""A thin wrapper over an HF fast tokenizer: text <-> ids and the model's chat template."""

from __future__ import annotations

import os
from typing import Any

# Loading must never reach a hub: this engine only reads local files.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Tokenizer:
    """What the engine and the API need from a tokenizer, independent of where it came from."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: list[int] | None = None) -> None:
        self.hf = hf_tokenizer
        ids = list(eos_token_ids or [])
        if hf_tokenizer.eos_token_id is not None and hf_tokenizer.eos_token_id not in ids:
            ids.append(hf_tokenizer.eos_token_id)
        self.eos_token_ids = ids

    @classmethod
    def from_hf_dir(cls, path: str, eos_token_ids: list[int] | None = None) -> Tokenizer:
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot load a tokenizer from {path}: {e}") from e
        return cls(hf, eos_token_ids)

    @classmethod
    def from_gguf(cls, path: str, eos_token_ids: list[int] | None = None) -> Tokenizer:
        # The backend class directly, not AutoTokenizer: the latter first builds a model
        # config from the GGUF, which parses the whole vocabulary again (~4 s vs ~0.4 s).
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        directory, name = os.path.split(os.path.abspath(path))
        try:
            hf = TokenizersBackend.from_pretrained(directory, gguf_file=name, local_files_only=True)
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"cannot build a tokenizer from GGUF metadata of {path}: {e}") from e
        return cls(hf, eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text``; ``add_special_tokens`` adds BOS where the model wants it."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """The prompt text the model's chat template makes, ending with the assistant cue."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        return self.hf.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of ``chat_prompt(messages, tools)``; the template writes any BOS itself."""
        return self.encode(self.chat_prompt(messages, tools), add_special_tokens=False)
