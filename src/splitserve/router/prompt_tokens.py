"""The prompt token ids a worker will see, computed in the router (without torch).

The router loads the model directory's tokenizer as the worker does (``common/tokenizer.py``:
``tokenizers`` and jinja2, no torch), so its ids are the worker's once messages are turned
into template input as the worker turns them (``worker/prepare.py``: ``developer`` is
``system``, text parts joined by newlines, tool-call arguments parsed from JSON). A text
completion's prompt is encoded as it is, special tokens added.

The proxy attaches the ids to each request's ``RequestInfo`` for the policies.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2

from splitserve.common.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class ChatTokenizer:
    """Token ids of OpenAI requests, for one model."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def from_dir(cls, path: str) -> ChatTokenizer:
        """From a model or tokenizer directory (``tokenizer.json``, and the chat template in
        ``chat_template.jinja`` or ``tokenizer_config.json``)."""
        if not (Path(path) / "tokenizer.json").is_file():  # the router never needs transformers
            raise ValueError(f"cannot load {Path(path) / 'tokenizer.json'}: no such file")
        return cls(Tokenizer.from_hf_dir(path))

    def chat_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The ids of the conversation so far, ending with the assistant cue."""
        return self.tokenizer.apply_chat_template([_message(m) for m in messages], tools)

    def text_ids(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

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
