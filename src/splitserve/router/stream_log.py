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

    def record(self, text: str, choice: dict[str, Any]) -> None:
        """Count a chunk's ids: pending until a chunk with text (or the last) settles them."""
        self.pending += choice.get("token_ids") or []
        if text:
            self.settled += self.pending
            self.pending = []
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
            self.settled += self.pending  # the worker flushed all text with its last token
            self.pending = []

    def note_offsets(self, lp: dict[str, Any]) -> None:
        """Record where the text of each token of a text completion's chunk ends, once
        ``record`` has counted its ids (one log-probability entry per id)."""
        ends = [o + len(t) for o, t in zip(lp["text_offset"], lp["tokens"], strict=True)]
        self.offset_ends[self.length - len(ends) :] = ends

    def drop_sent_logprobs(self, choice: dict[str, Any]) -> None:
        """Drop from ``choice`` the log-probabilities of tokens the client has had (tokens
        regenerated after a resume), once ``record`` has counted its ids."""
        start = self.length - len(choice.get("token_ids") or [])  # the chunk's first token
        have = self.logprobs_sent - start
        self.logprobs_sent = max(self.logprobs_sent, self.length)
        if have <= 0:
            return
        lp = choice["logprobs"]
        if "content" in lp:  # chat
            lp["content"] = lp["content"][have:]
            fresh = bool(lp["content"])
        else:  # text completion: parallel lists, one entry per token
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                lp[key] = lp[key][have:]
            fresh = bool(lp["tokens"])
        if not fresh:
            choice["logprobs"] = None

    def unsent_ids(self, choice: dict[str, Any]) -> list[int] | None:
        """The chunk's ids the client has not had (regenerated ones it got before a failure
        are dropped from ``choice``), once ``record`` has counted them; None if none."""
        ids = choice.get("token_ids") or []
        end = self.length  # the output's length after these ids
        fresh = ids[max(0, self.ids_sent - (end - len(ids))) :]
        self.ids_sent = max(self.ids_sent, end)
        if len(fresh) < len(ids):
            if fresh:
                choice["token_ids"] = fresh
            else:
                choice.pop("token_ids", None)
        return fresh or None


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
