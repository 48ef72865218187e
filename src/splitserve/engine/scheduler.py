"""Continuous batching with chunked prefill and preemption by recompute. Pure Python, no torch.

Each step has a token budget (``max_num_batched_tokens``). Running sequences are served
first, oldest first: a decode costs one token, an unfinished prefill takes the next chunk
that fits. Waiting sequences are admitted with what is left, their cached prefix skipped.
When blocks run out, the newest running sequence is preempted: its blocks are freed (they
stay in the prefix cache) and it goes back to the front of the queue to be recomputed.

Waiting sequences are admitted in arrival order (``policy="fcfs"``), or with
``policy="shortest-prefill"`` the one with the fewest tokens left to compute first (its
prompt less what the prefix cache and the lower KV tiers hold): under a burst, a returning
session's short new turn then starts before a long cold prompt, so more requests meet a
time-to-first-token objective. A sequence overtaken ``max_overtakes`` times goes first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from splitserve.config import check_scheduling_policy
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.plan import ScheduledChunk, StepPlan, StepResult
from splitserve.engine.sequence import Sequence, SequenceStatus
from splitserve.engine.tiering import Admission, Tiering


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 4096
    policy: str = "fcfs"
    max_overtakes: int = 16  # shortest-prefill: the bound on how often one can be passed

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_overtakes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_scheduling_policy(self.policy)


@dataclass(slots=True)
class SequenceUpdate:
    seq: Sequence
    new_token: int | None  # None when the step only advanced the prefill
    finished: bool


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, tiering: Tiering | None = None
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.tiering = tiering  # lower KV tiers and retention pins, if configured
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ---- bookkeeping ---------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.num_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {seq.num_tokens} tokens; the maximum model length is "
                f"{self.config.max_model_len} (prompt plus at least one generated token)"
            )
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        loading = self.tiering.abort(request_id) if self.tiering is not None else None
        if loading is not None:  # holds no blocks yet: its load lands in the cache anyway
            loading.status, loading.finish_reason = SequenceStatus.FINISHED, "abort"
            return loading
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    self.finish(seq, "abort")
                    return seq
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.finish_reason = reason
        if self.tiering is not None:
            self.tiering.retain(seq)
        if not (seq.keep_blocks and reason != "abort"):
            self.block_manager.free(seq)
        # else: the blocks stay referenced for a remote decode; whoever holds the lease
        # releases ``seq.block_table`` later.
        seq.status = SequenceStatus.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or (self.tiering and self.tiering.busy))

    def resume(self, seq: Sequence) -> None:
        """Put a sequence whose prefix was loaded from a lower tier back at the front."""
        self.waiting.appendleft(seq)

    # ---- schedule ------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        budget, preempted = self._schedule_running(plan, budget)
        if not preempted:
            self._schedule_waiting(plan, budget)
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int) -> tuple[int, bool]:
        preempted = False
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.can_append(seq, n):
                preempted = True
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                plan.chunks.append(self._chunk(seq, n))
                budget -= n
        return budget, preempted

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> None:
        bm = self.block_manager
        room = budget > 0 and len(self.running) < self.config.max_num_seqs
        order = self.config.policy != "fcfs" and room and len(self.waiting) > 1
        arrival = self._order_waiting() if order else None
        admitted: list[int] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            match = bm.match_prefix(seq)
            if self.tiering is not None:
                admission = self.tiering.start_load(seq, match)
                if admission is Admission.WAIT:
                    break
                if admission is Admission.LOADING:
                    self.waiting.popleft()  # back via ``resume`` once its blocks are loaded
                    continue
            n = min(seq.num_tokens - match.num_blocks * bm.block_size, budget)
            if not bm.can_allocate(match, n, seq):
                break
            self.waiting.popleft()
            if arrival is not None:
                admitted.append(arrival[id(seq)])
            bm.allocate(seq, match)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            plan.chunks.append(self._chunk(seq, n))
            budget -= n
        if arrival is not None and admitted:
            for seq in self.waiting:  # count the later arrivals admitted ahead of each
                rank = arrival.get(id(seq))
                if rank is not None:
                    seq.num_overtaken += sum(r > rank for r in admitted)

    def _order_waiting(self) -> dict[int, int]:
        """Sort the queue for ``shortest-prefill``; returns each sequence's rank in arrival
        order (the queue's order before this sort), by ``id``."""
        bm, tiering = self.block_manager, self.tiering
        queue = list(self.waiting)

        def key(item: tuple[int, Sequence]) -> tuple[int, int, int]:
            rank, seq = item
            if seq.num_overtaken >= self.config.max_overtakes:
                return (0, 0, rank)
            match = bm.match_prefix(seq)
            held = match.num_blocks + (tiering.blocks_below(seq, match) if tiering else 0)
            return (1, seq.num_tokens - held * bm.block_size, rank)

        self.waiting = deque(seq for _, seq in sorted(enumerate(queue), key=key))
        return {id(seq): rank for rank, seq in enumerate(queue)}

    def _chunk(self, seq: Sequence, n: int) -> ScheduledChunk:
        self.block_manager.append_slots(seq, n)
        start = seq.num_computed_tokens
        return ScheduledChunk(
            request_id=seq.request_id,
            token_ids=seq.token_ids[start : start + n],
            start_pos=start,
            block_table=list(seq.block_table),
            sample=start + n == seq.num_tokens,
            params=seq.params,
            num_output_tokens=seq.num_output_tokens,
        )

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- update --------------------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult) -> list[SequenceUpdate]:
        """Advance every scheduled sequence past its chunk and apply the sampled tokens."""
        by_id = {seq.request_id: seq for seq in self.running}
        updates: list[SequenceUpdate] = []
        for chunk in plan.chunks:
            seq = by_id.get(chunk.request_id)
            if seq is None:
                continue  # aborted while the step ran
            seq.num_computed_tokens += chunk.num_tokens
            published = self.block_manager.cache_full_blocks(seq)
            if self.tiering is not None:
                self.tiering.on_cached(published)
            if not chunk.sample:
                updates.append(SequenceUpdate(seq, None, False))
                continue
            token = result.sampled[seq.request_id]
            seq.token_ids.append(token)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason)
            updates.append(SequenceUpdate(seq, token, reason is not None))
        return updates

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if not params.ignore_eos and token in seq.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if seq.num_output_tokens >= params.max_tokens:
            return "length"
        if seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None
