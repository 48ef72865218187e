"""Which session a request belongs to, and which shared prefix it starts with.

The session key picks the decode worker, so every turn of a session must produce the same
key. In order of preference:

1. header ``X-Session-Id`` (the client says so);
2. body ``session_id``;
3. body ``user`` (OpenAI's end-user id: one user's turns share a cache);
4. a hash of how the conversation began: the system prompt(s) and the first user message
   for chat, the first ``prefix_chars`` characters (or ``prefix_tokens`` token ids) of the
   prompt for text completions. Later turns append to a conversation but never change its
   beginning, so a client that sends nothing still gets stickiness.

Per-request ids (``X-Request-Id``, a body ``request_id``) change every turn and are never
used: they would scatter a session across workers.

A Responses API request (``/v1/responses``) is keyed by its response chain instead
(:func:`chain_key`): the chain is written into every response id of it, so a turn's
``previous_response_id`` names its session. A first turn gets a new chain, which the router
names to the worker (``x-splitserve-response-chain``) and the worker puts into the ids.
Nothing is remembered here: any router replica, restarted or not, keys a chain alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import xxhash

from splitserve.common.responses_api import (
    CHAIN_HEADER,
    RESPONSES_PATH,
    chain_of,
    chain_session,
    new_chain,
)

SESSION_HEADER = "x-session-id"
DEFAULT_PREFIX_CHARS = 512
DEFAULT_PREFIX_TOKENS = 128


class SessionKey(NamedTuple):
    """The key and where it came from (``header``, ``session_id``, ``user``, ``prefix``)."""

    key: str
    source: str


def session_key(
    headers: Mapping[str, str],
    body: Mapping[str, Any],
    prefix_chars: int = DEFAULT_PREFIX_CHARS,
    prefix_tokens: int = DEFAULT_PREFIX_TOKENS,
) -> SessionKey | None:
    """The request's session key, or None when nothing identifies it (an empty prompt)."""
    header = _header(headers, SESSION_HEADER)
    if header:
        return SessionKey(header, "header")
    for field in ("session_id", "user"):
        value = body.get(field)
        if isinstance(value, str | int) and not isinstance(value, bool) and str(value):
            return SessionKey(str(value), field)
    start = conversation_start(body, prefix_chars, prefix_tokens)
    if start is None:
        return None
    return SessionKey(f"prefix:{_digest(start)}", "prefix")


def keyed_by_chain(path: str) -> bool:
    """Whether requests to ``path`` are keyed by their response chain (``chain_key``)."""
    return path == RESPONSES_PATH


def chain_key(body: Mapping[str, Any]) -> tuple[SessionKey, dict[str, str]]:
    """A Responses request's session key, and the headers that name a first turn's new
    chain to the worker (none when the request continues a chain). A
    ``previous_response_id`` this server did not make keys by itself; the worker answers
    that it does not know it."""
    previous = body.get("previous_response_id")
    if isinstance(previous, str) and previous:
        chain = chain_of(previous)
        key = chain_session(chain) if chain is not None else f"response:{previous}"
        return SessionKey(key, "previous_response_id"), {}
    chain = new_chain()
    return SessionKey(chain_session(chain), "response_chain"), {CHAIN_HEADER: chain}


def prefix_key(body: Mapping[str, Any], prefix_chars: int = DEFAULT_PREFIX_CHARS) -> str | None:
    """A name for the part of the prompt most likely shared *across* sessions.

    For chat that is the system prompt (agents of one kind share it), or the first message
    when there is none; for text completions the first ``prefix_chars`` characters. Prefill
    placement hashes it so that requests sharing it meet the same prefill worker's cache.
    """
    messages = body.get("messages")
    if isinstance(messages, list):
        system = [m for m in messages if _role(m) in ("system", "developer")]
        first = system or messages[:1]
        text = "".join(_message_text(m) for m in first)[:prefix_chars]
        return f"shared:{_digest(text)}" if text else None
    start = _prompt_start(body.get("prompt"), prefix_chars, DEFAULT_PREFIX_TOKENS)
    return None if start is None else f"shared:{_digest(start)}"


def conversation_start(
    body: Mapping[str, Any], prefix_chars: int, prefix_tokens: int
) -> str | None:
    """The text that names a conversation: what never changes from one turn to the next."""
    messages = body.get("messages")
    if isinstance(messages, list):
        head: list[str] = []
        for m in messages:
            role = _role(m)
            if role in ("system", "developer", "user"):
                head.append(f"{role}\x00{_message_text(m)}\x00")
            if role == "user":
                break  # the first user message ends the part every turn repeats
        return "".join(head) or None
    return _prompt_start(body.get("prompt"), prefix_chars, prefix_tokens)


def _prompt_start(prompt: Any, prefix_chars: int, prefix_tokens: int) -> str | None:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a one-element batch
    if isinstance(prompt, str):
        return prompt[:prefix_chars] or None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return "tokens:" + ",".join(str(t) for t in prompt[:prefix_tokens])
    return None


def _role(message: Any) -> str | None:
    return message.get("role") if isinstance(message, dict) else None


def _message_text(message: Any) -> str:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        return "".join(
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    return ""


def _header(headers: Mapping[str, str], name: str) -> str:
    for k, v in headers.items():
        if k.lower() == name:
            return v.strip()
    return ""


def _digest(text: str) -> str:
    return xxhash.xxh3_128_hexdigest(text.encode("utf-8", "surrogatepass"))
