"""What the engine hands back, shaped like vLLM's ``RequestOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.engine.plan import TokenLogprobs


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort"
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the params ask for them


@dataclass(slots=True)
class KeptBlocks:
    """KV blocks a finished prefill holds for a remote decode (``keep_blocks=True``).

    ``block_ids`` are all the request's blocks (released together); the first
    ``len(hashes)`` of them are full and named by ``hashes``.
    """

    block_ids: list[int]
    hashes: list[bytes]


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # Streaming helpers: what this step added (text and tokens) since the previous output.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] | None = None
    kept_blocks: KeptBlocks | None = None
