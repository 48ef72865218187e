"""What crosses from the scheduler (pure Python) to the model runner (tensors) and back.

Plain, serialisable dataclasses only: the cluster simulator replays the same plans against a
cost model instead of a model runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from splitserve.common.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledChunk:
    """One sequence's share of a step: ``token_ids`` sit at positions
    ``start_pos .. start_pos + len(token_ids) - 1`` and their KV goes into the slots that
    ``block_table`` maps those positions to (slot = block_table[pos // B] * B + pos % B).
    Positions before ``start_pos`` are already in the cache.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool  # the chunk ends at the sequence's last token: sample the next one
    params: SamplingParams
    num_output_tokens: int = 0  # tokens generated so far; indexes a seeded request's RNG stream

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(slots=True)
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


class TokenLogprobs(NamedTuple):
    """A sampled token's log-probability and its most likely alternatives ``(id, logprob)``."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class StepResult:
    """Sampled token per request id, for every chunk that had ``sample=True``; and for those
    whose params ask for ``logprobs``, the token's log-probabilities."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
