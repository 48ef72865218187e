"""What a streamed request has delivered to its client, per choice, in tokens and in shape:
the log ``migration`` keeps while relaying and resumes from (``replay`` reads it too)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

COMPLETION_DEFAULT_MAX_TOKENS = 16  # the workers' default for /v1/completions


@dataclass(slots=True)
class ChoiceLog:
    """What one choice of a streamed request has delivered to its client, in tokens."""

    settled: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    calls_sent: bool = False  # the chunk with the reply's tool calls (they end it; builtin)
    # ``replay``: whether the client has had a chunk of this choice, the characters of text it
    # has had, and the ids and characters of skipped text of the current replayed leg.
    opened: bool = False
    chars: int = 0
    replayed: int = 0
    replayed_chars: int = 0
    ids_sent: int = 0  # output ids the client has had (``client_wants_ids``)
    logprobs_sent: int = 0  # output tokens whose log-probabilities the client has had
    # A text completion's log-probabilities: where each output token's text ends (its
    # ``text_offset`` plus its length), and that of the last settled token when the current
    # resumed leg began, whose offsets count from 0 again.
    offset_ends: list[int] = field(default_factory=list)
    offset_base: int = 0

    @property
    def ended(self) -> bool:
        """Whether the client has its end (the finish chunk, or the calls that precede it)."""
        return self.finish_reason is not None or self.calls_sent

    @property
    def length(self) -> int:
        return len(self.settled) + len(self.pending)


@dataclass(slots=True)
class StreamLog:
    """What one streamed request has delivered to its client, in tokens and in shape."""

    chat: bool
    max_tokens: int | None  # None: the rest of the context window (chat only)
    client_wants_ids: bool = False
    include_usage: bool = False
    head: dict[str, Any] = field(default_factory=dict)  # id, object, created, model
    prompt_ids: list[int] | None = None
    choices: list[ChoiceLog] = field(default_factory=lambda: [ChoiceLog()])  # by index
    usage_sent: bool = False
    done: bool = False

    @classmethod
    def of(cls, body: dict[str, Any], chat: bool) -> StreamLog:
        if chat:
            max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        else:
            max_tokens = body.get("max_tokens") or COMPLETION_DEFAULT_MAX_TOKENS
        options = body.get("stream_options")
        n = body.get("n")
        return cls(
            chat=chat,
            max_tokens=max_tokens if isinstance(max_tokens, int) else None,
            client_wants_ids=body.get("return_token_ids") is True,
            include_usage=isinstance(options, dict) and options.get("include_usage") is True,
            choices=[ChoiceLog() for _ in range(n if isinstance(n, int) and n > 1 else 1)],
        )

    @property
    def resumable(self) -> bool:
        """Whether the worker told us enough to resume (it supports ``return_token_ids``)."""
        return self.prompt_ids is not None and not self.done

    @property
    def ended(self) -> bool:
        """Whether every choice has ended (only the usage and ``[DONE]`` may be missing)."""
        return all(c.ended for c in self.choices)
