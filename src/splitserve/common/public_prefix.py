"""Public prefixes: prompt openings (a common system prompt) that one tenant's keys may share.

A tenant declares them in the keys file (``common/tenants.py``); each is a text, tokenized
as a text completion's prompt is, or chat messages, rendered with the model's chat template
as a chat request's are (with the assistant cue, as a whole conversation would end)::

    "public_prefixes": ["You are Acme's support assistant. ...",
                        {"messages": [{"role": "system", "content": "You are ..."}]}]

A request shares the leading tokens its prompt has in common with a declared prefix, the
longest such run: those tokens are the tenant's public text, whoever sends them, so sharing
their KV tells a key nothing about another key's prompts. Only whole blocks within that run
are shared (``common.kv_hash.split_salt``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "developer", "user", "assistant")
TextIds = Callable[[str], list[int]]
ChatIds = Callable[[list[dict[str, Any]]], list[int]]


@dataclass(frozen=True, slots=True)
class PublicPrefix:
    """One declared prefix: ``text``, or chat ``messages`` as (role, content) pairs."""

    text: str | None = None
    messages: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, raw: Any, where: str) -> PublicPrefix:
        if isinstance(raw, str):
            if not raw:
                raise ValueError(f"{where} is an empty text")
            return cls(text=raw)
        if not isinstance(raw, dict) or set(raw) != {"messages"}:
            raise ValueError(f'{where} must be a text or {{"messages": [...]}}')
        messages = raw["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}: messages must be a non-empty list")
        return cls(
            messages=tuple(_message(m, f"{where}, message {i}") for i, m in enumerate(messages))
        )

    def token_ids(self, text_ids: TextIds, chat_ids: ChatIds) -> list[int]:
        if self.text is not None:
            return list(text_ids(self.text))
        return list(chat_ids([{"role": r, "content": c} for r, c in self.messages]))


def _message(raw: Any, where: str) -> tuple[str, str]:
    if not isinstance(raw, dict) or set(raw) != {"role", "content"}:
        raise ValueError(f"{where} must be an object with exactly role and content")
    role, content = raw["role"], raw["content"]
    if role not in ROLES:
        raise ValueError(f"{where}: role must be one of {', '.join(ROLES)}")
    if not isinstance(content, str) or not content:
        raise ValueError(f"{where}: content must be a non-empty string")
    return role, content


def parse_prefixes(raw: Any, where: str) -> tuple[PublicPrefix, ...]:
    """A tenant's ``public_prefixes``: a non-empty list of texts or message lists."""
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{where}: public_prefixes must be a non-empty list")
    return tuple(PublicPrefix.parse(p, f"{where}: public prefix {i}") for i, p in enumerate(raw))


def shared_tokens(prompt: Sequence[int], prefixes: Sequence[Sequence[int]]) -> int:
    """How many leading tokens ``prompt`` has in common with the one of ``prefixes`` it
    agrees with longest."""
    best = 0
    for prefix in prefixes:
        n = min(len(prompt), len(prefix))
        i = 0
        while i < n and prompt[i] == prefix[i]:
            i += 1
        best = max(best, i)
    return best
