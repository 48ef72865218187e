"""A request as the scheduler sees it: tokens, progress through them, and its KV blocks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from splitserve.common.kv_hash import BlockChain, BlockHash
from splitserve.common.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One request's state.

    ``token_ids`` holds the prompt followed by the generated tokens. The KV of the first
    ``num_computed_tokens`` of them is in the cache, in the blocks of ``block_table``. The
    last token is always uncomputed while the request runs: computing it yields the next.
    """

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    root_hash: BlockHash
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = 0.0
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)  # of the full blocks, in order
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    keep_blocks: bool = False  # prefill for a remote decode: hold the KV after finishing
    # Tier ladder: keep the KV pinned for this long after finishing (None: only on a
    # finish in tool calls), under the quota of ``session_id`` (default: the request).
    retention_s: float | None = None
    session_id: str | None = None
    tier_checked: bool = False  # lower tiers hold nothing more for it (never load twice)
    num_overtaken: int = 0  # later arrivals admitted ahead of it (shortest-prefill policy)
    # The full blocks' hashes, computed once for every lookup and registration; a caller
    # may pass a chain it already has (a session's previous turn), see ``BlockChain``.
    chain: BlockChain | None = None

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
