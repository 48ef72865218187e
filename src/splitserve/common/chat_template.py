"""A model's chat template, rendered as ``transformers`` renders it, without importing it.

The template comes from a tokenizer directory (``chat_template.jinja``, else the
``chat_template`` of ``tokenizer_config.json``: one string, or named templates such as
``tool_use``). It is rendered in a sandboxed jinja2 environment with the settings, filters and
globals ``transformers`` gives templates, with ``add_generation_prompt=True`` and the named
special tokens as variables. Worker and router both render through this class, so the
prompt ids the router predicts are the ones the worker computes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplate:
    """Named templates (``default``, optionally ``tool_use``) and the special tokens they see."""

    def __init__(
        self, templates: Mapping[str, str], special_tokens: Mapping[str, str] | None = None
    ) -> None:
        self.sources = dict(templates)
        self.special_tokens = dict(special_tokens or {})
        env = _template_env()
        self._templates = {name: env.from_string(t) for name, t in templates.items()}

    @classmethod
    def from_dir(cls, root: Path, config: Mapping[str, Any]) -> ChatTemplate:
        """From a tokenizer directory and its parsed ``tokenizer_config.json``."""
        templates: dict[str, str] = {}
        configured = config.get("chat_template")
        if isinstance(configured, str):
            templates["default"] = configured
        elif isinstance(configured, list):
            templates.update({t["name"]: t["template"] for t in configured})
        if (root / "chat_template.jinja").is_file():
            templates["default"] = (root / "chat_template.jinja").read_text()
        return cls(templates, special_tokens(config))

    def __bool__(self) -> bool:
        return "default" in self._templates

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """The prompt text of ``messages`` (and ``tools``), ending with the assistant cue."""
        template = self._templates.get("tool_use") if tools else None
        template = template or self._templates.get("default")
        if template is None:
            raise ValueError("this model's tokenizer has no chat template")
        return template.render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=True,
            **self.special_tokens,
        )


def special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens of a ``tokenizer_config.json`` (strings or AddedTokens)."""
    out = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):  # an AddedToken, serialized
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def _template_env() -> ImmutableSandboxedEnvironment:
    """The environment ``transformers`` renders chat templates in (the parts templates use)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Not jinja's own filter, which escapes HTML characters.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
