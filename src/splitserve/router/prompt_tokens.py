"""The prompt token ids a worker will see, computed in the router (without torch).

A model directory's ``tokenizer.json`` (the ``tokenizers`` library) and chat template
(jinja2, set up as ``transformers`` sets it up) give the same ids as the worker's
``apply_chat_template``: the template rendered with ``add_generation_prompt=True`` and the
named special tokens, then encoded without adding special tokens (the template writes
them). Messages are turned into template input as the worker turns them
(``worker/prepare.py``: ``developer`` is ``system``, text parts joined by newlines,
tool-call arguments parsed from JSON). A text completion's prompt is encoded as it is,
special tokens added.

The proxy attaches the ids to each request's ``RequestInfo`` for the policies.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

log = logging.getLogger(__name__)

SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTokenizer:
    """Token ids of OpenAI requests, for one model."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        templates: Mapping[str, str],
        special_tokens: Mapping[str, str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.special_tokens = dict(special_tokens or {})
        self._env = _template_env()
        self._templates = {name: self._env.from_string(t) for name, t in templates.items()}

    @classmethod
    def from_dir(cls, path: str) -> ChatTokenizer:
        """From a model or tokenizer directory (``tokenizer.json``, and the chat template in
        ``chat_template.jinja`` or ``tokenizer_config.json``)."""
        root = Path(path)
        try:
            tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        except Exception as e:  # the library raises plain Exceptions
            raise ValueError(f"cannot load {root / 'tokenizer.json'}: {e}") from e
        config_file = root / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        return cls(tokenizer, _templates(root, config), _special_tokens(config))

    def chat_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The ids of the conversation so far, ending with the assistant cue."""
        template = self._templates.get("tool_use") if tools else None
        template = template or self._templates.get("default")
        if template is None:
            raise ValueError("this tokenizer has no chat template")
        text = template.render(
            messages=[_message(m) for m in messages],
            tools=tools,
            documents=None,
            add_generation_prompt=True,
            **self.special_tokens,
        )
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def text_ids(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True).ids

    def request_ids(self, body: Mapping[str, Any]) -> list[int] | None:
        """The prompt ids of a chat or text completion request body; None when there are
        none to give (a malformed request: the worker will say what is wrong with it)."""
        try:
            if "messages" in body:
                return self.chat_ids(body["messages"], _offered_tools(body))
            return _prompt_ids(body.get("prompt"), self.text_ids)
        except (ValueError, TypeError, KeyError, AttributeError, jinja2.TemplateError) as e:
            log.debug("cannot tokenize a request in the router: %r", e)
            return None


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


def _templates(root: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Named chat templates: ``chat_template.jinja`` is the default, as for transformers."""
    templates: dict[str, str] = {}
    configured = config.get("chat_template")
    if isinstance(configured, str):
        templates["default"] = configured
    elif isinstance(configured, list):
        templates.update({t["name"]: t["template"] for t in configured})
    if (root / "chat_template.jinja").is_file():
        templates["default"] = (root / "chat_template.jinja").read_text()
    return templates


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    out = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):  # an AddedToken, serialized
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def _offered_tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    return tools if tools and body.get("tool_choice") != "none" else None


def _message(msg: Mapping[str, Any]) -> dict[str, Any]:
    role = msg["role"]
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    out["content"] = _text(msg.get("content"))
    for name in ("name", "tool_call_id"):
        if msg.get(name) is not None:
            out[name] = msg[name]
    if msg.get("tool_calls"):
        out["tool_calls"] = [_tool_call(tc) for tc in msg["tool_calls"]]
    return out


def _text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if any(part.get("type") != "text" for part in content):
        raise ValueError("only text content parts are supported")
    return "\n".join(part["text"] for part in content)


def _tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    """As the worker's schema dumps it (``id`` only when given), arguments as a mapping."""
    out: dict[str, Any] = {} if call.get("id") is None else {"id": call["id"]}
    function = call["function"]
    args = function.get("arguments", "")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            args = parsed
    out["type"] = call.get("type", "function")
    out["function"] = {"name": function["name"], "arguments": args}
    return out


def _prompt_ids(prompt: Any, encode) -> list[int] | None:
    """A text completion's prompt: a string, token ids, or a batch of one of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    return None
