"""Tool calls in generated text, in the Hermes format most open chat models use.

A model that was given ``tools`` answers a call as ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``, one block per call, possibly after some plain text. This module turns
such text into OpenAI ``tool_calls``: whole (:func:`parse_tool_calls`) and while streaming
(:class:`ToolCallStream`, which holds back text that may be the start of a call so that no
markup ever reaches the client as content).

A block that is not a JSON object with a string ``name`` makes the whole reply plain
content: a half-parsed answer is worse than an unparsed one, and the client still sees
every character the model wrote.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(slots=True)
class ParsedReply:
    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def parse_tool_calls(text: str) -> ParsedReply:
    """Split ``text`` into the content before the first call and the calls themselves."""
    start = text.find(OPEN)
    if start < 0:
        return ParsedReply(text)
    calls = []
    for block in _blocks(text[start:]):
        call = _call(block)
        if call is None:
            return ParsedReply(text)
        calls.append(call)
    return ParsedReply(text[:start].strip() or None, calls)


def finish_reason_with_calls(finish_reason: str | None, calls: list[dict[str, Any]]) -> str | None:
    """OpenAI reports ``tool_calls`` when a reply that stopped by itself called tools."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def _blocks(text: str) -> list[str]:
    """The bodies of the ``<tool_call>`` blocks of ``text`` (which starts with one); the last
    block may lack its closing tag when the model stopped right after the JSON."""
    bodies = []
    for part in text.split(OPEN)[1:]:
        body, _, _ = part.partition(CLOSE)
        bodies.append(body)
    return bodies


def _call(body: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": arguments},
    }


class ToolCallStream:
    """Filters a streamed reply: content flows through as it comes, except text that is or
    may become a ``<tool_call>`` block, which is held until :meth:`finish` parses it."""

    def __init__(self) -> None:
        self._text = ""
        self._sent = 0  # characters of ``_text`` already released as content
        self._in_call = False

    def feed(self, delta: str) -> str:
        """Append generated text; return the part that is safe to send as content now."""
        self._text += delta
        if self._in_call:
            return ""
        start = self._text.find(OPEN, self._sent)
        if start >= 0:
            self._in_call = True
            return self._release(start)
        return self._release(len(self._text) - _partial_open(self._text))

    def finish(self) -> ParsedReply:
        """At the end of the reply: the content still held and the calls, if any parsed."""
        rest = self._text[self._sent :]
        self._sent = len(self._text)
        if not self._in_call:
            return ParsedReply(rest or None)
        parsed = parse_tool_calls(rest)
        return parsed if parsed.tool_calls else ParsedReply(rest)

    def _release(self, end: int) -> str:
        out = self._text[self._sent : end]
        self._sent = end
        return out


def _partial_open(text: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``OPEN``."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return k
    return 0
