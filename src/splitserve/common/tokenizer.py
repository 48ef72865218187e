"""Text <-> ids and the model's chat template, over the ``tokenizers`` library.

A tokenizer directory (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``,
as the model cache and most HF models hold it) loads without ``transformers``, which costs a
worker about a second of start-up to import. ``transformers`` is imported only to build a
tokenizer from GGUF metadata (once per model: the cache keeps the result) or from a directory
without ``tokenizer.json``. Ids, text and prompts are the ones ``transformers`` gives
(tests/models/test_tokenizer.py holds that).
"""

from __future__ import annotations

import json
import os
from copy import copy
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from splitserve.common.chat_template import ChatTemplate, special_tokens

# Loading must never reach a hub: this engine only reads local files.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Tokenizer:
    """What the engine and the API need from a tokenizer, independent of where it came from."""

    def __init__(
        self,
        backend: Backend,
        template: ChatTemplate,
        eos_token_ids: list[int] | None = None,
    ) -> None:
        self.backend = backend
        self.template = template
        eos = template.special_tokens.get("eos_token")
        self.eos_token_id: int | None = None if eos is None else backend.token_to_id(eos)
        ids = list(eos_token_ids or [])
        if self.eos_token_id is not None and self.eos_token_id not in ids:
            ids.append(self.eos_token_id)
        self.eos_token_ids = ids

    @classmethod
    def from_hf_dir(cls, path: str, eos_token_ids: list[int] | None = None) -> Tokenizer:
        root = Path(path)
        if not (root / "tokenizer.json").is_file():  # e.g. only a sentencepiece model
            return cls._from_transformers_dir(path, eos_token_ids)
        config_file = root / "tokenizer_config.json"
        try:
            backend = Backend.from_file(str(root / "tokenizer.json"))
            config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        except Exception as e:  # the library raises plain Exceptions
            raise ValueError(f"cannot load a tokenizer from {path}: {e}") from e
        _check_no_cleanup(backend, config, path)
        return cls(backend, ChatTemplate.from_dir(root, config), eos_token_ids)

    @classmethod
    def _from_transformers_dir(cls, path: str, eos_token_ids: list[int] | None) -> Tokenizer:
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot load a tokenizer from {path}: {e}") from e
        return cls._from_hf(hf, eos_token_ids, path)

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
        return cls._from_hf(hf, eos_token_ids, path)

    @classmethod
    def _from_hf(cls, hf: Any, eos_token_ids: list[int] | None, path: str) -> Tokenizer:
        """From a ``transformers`` fast tokenizer: its Rust tokenizer, template and tokens."""
        if not hasattr(hf, "backend_tokenizer"):
            raise ValueError(f"cannot load a tokenizer from {path}: no fast tokenizer for it")
        backend = copy(hf.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        _check_no_cleanup(
            backend, {"clean_up_tokenization_spaces": hf.clean_up_tokenization_spaces}, path
        )
        chat = hf.chat_template
        templates = chat if isinstance(chat, dict) else ({"default": chat} if chat else {})
        config = {k: v for k, v in hf.special_tokens_map.items() if isinstance(v, str)}
        return cls(backend, ChatTemplate(templates, special_tokens(config)), eos_token_ids)

    def save(self, directory: str | os.PathLike) -> None:
        """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja``:
        a directory ``from_hf_dir`` (and ``transformers``) loads."""
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(root / "tokenizer.json"))
        config: dict[str, Any] = {"tokenizer_class": "TokenizersBackend"}
        config.update(self.template.special_tokens)
        named = {k: v for k, v in self.template.sources.items() if k != "default"}
        if named:
            config["chat_template"] = [{"name": k, "template": v} for k, v in named.items()]
        (root / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        if "default" in self.template.sources:
            (root / "chat_template.jinja").write_text(self.template.sources["default"])

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text``; ``add_special_tokens`` adds BOS where the model wants it."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """The prompt text the model's chat template makes, ending with the assistant cue."""
        return self.template.render(messages, tools)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of ``chat_prompt(messages, tools)``; the template writes any BOS itself."""
        return self.encode(self.chat_prompt(messages, tools), add_special_tokens=False)


def _check_no_cleanup(backend: Backend, config: dict[str, Any], path: str) -> None:
    """``transformers`` strips spaces before punctuation on decode for non-BPE tokenizers
    that ask for it; this class does not, so it refuses them instead of decoding otherwise."""
    if config.get("clean_up_tokenization_spaces") and type(backend.model).__name__ != "BPE":
        raise ValueError(
            f"cannot load a tokenizer from {path}: clean_up_tokenization_spaces with a "
            f"{type(backend.model).__name__} model is not supported"
        )
