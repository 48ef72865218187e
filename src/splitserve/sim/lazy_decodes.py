"""The decoding sequences of a simulated engine (``engine.SimEngine``), advanced lazily.

Each remembers the step it was last brought up to date (``_base``) and is touched again only
when it needs a new KV block (a *crossing*), finishes, or the real scheduler must see it
(``_demote_all``). Both events sit in heaps keyed by step; an entry is live while its tick is
the one ``_due`` holds for its sequence.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass, field

from splitserve.common.kv_hash import BlockHash
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.scheduler import Scheduler, SchedulerConfig
from splitserve.engine.sequence import Sequence
from splitserve.sim.cost_model import largest_within
from splitserve.sim.tiers import SimTiering


@dataclass(slots=True)
class StepReport:
    """What a finished step (or run of decode steps) produced."""

    first_tokens: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)


class LazyDecodes:
    """The lazy half of ``SimEngine``, which sets these attributes."""

    config: SchedulerConfig
    block_manager: BlockManager
    scheduler: Scheduler
    tiering: SimTiering | None
    outputs: Callable[[str], Sequence_[int]]
    exact: bool
    steps: int
    _n_dec: int
    _base: dict[Sequence, int]
    _order: dict[Sequence, int]
    _ctx_base: int
    _crossings: list[tuple[int, int, Sequence]]
    _finishes: list[tuple[int, int, Sequence]]
    _due: dict[Sequence, list[int]]
    _tick: int
    _blocked: bool
    _saves: list[tuple[int, int, int, BlockHash]]

    def _block_limited(self, steps: int) -> int:
        """The most steps (<= ``steps``) whose new blocks the pool holds without preemption."""
        free, b, bs = self.block_manager.num_free_blocks, self._n_dec, self.block_manager.block_size
        if b * (steps // bs + 1) <= free:
            return steps
        return largest_within(steps, lambda k: self._blocks_for(k) <= free)

    def _blocks_for(self, steps: int) -> int:
        bm, upto = self.block_manager, self.steps + steps
        need = 0
        for seq in self.scheduler.running[: self._n_dec]:
            tokens = seq.num_computed_tokens + upto - self._base[seq]
            need += max(0, bm.blocks_needed(tokens) - len(seq.block_table))
        return need

    def _allocate_decode_step(self) -> bool:
        """Give every decoding sequence that needs one its block for the next step."""
        step = self.steps + 1
        due = []
        while self._crossings and self._crossings[0][0] <= step:
            entry = heapq.heappop(self._crossings)
            if self._live(entry, 0):
                due.append(entry)
        if len(due) > self.block_manager.num_free_blocks:
            for entry in due:
                heapq.heappush(self._crossings, entry)
            return False
        for _, _, seq in due:
            self.block_manager.append_slots(seq, step - self._base[seq])
            self._schedule(seq)
        return True

    def _advance(self, upto: int, report: StepReport) -> None:
        """Bring the decoding sequences to ``upto`` steps: blocks, then finishes."""
        # With lower tiers, blocks that fill at ``upto`` itself are published now too (their
        # sequence needs its next block only one step later): saved at their own step.
        last = upto if self.tiering is None else upto + 1
        touched = []
        while self._crossings and self._crossings[0][0] <= last:
            entry = heapq.heappop(self._crossings)
            if self._live(entry, 0):
                self._materialize(entry[2], upto)
                touched.append(entry[2])
        for seq in touched:
            self._schedule(seq)
        done = []
        while self._finishes and self._finishes[0][0] <= upto:
            entry = heapq.heappop(self._finishes)
            if self._live(entry, 1):
                done.append(entry[2])
        self.steps = upto
        done.sort(key=self._order.__getitem__)
        for seq in done:
            self._materialize(seq, upto)
            self._retire(seq)
            self.scheduler.finish(seq, "length")
            report.finished.append(seq)
        if done:
            self._blocked = False
        if self._saves:
            self._save_in_order()

    def _materialize(self, seq: Sequence, upto: int) -> None:
        k = upto - self._base[seq]
        if k <= 0:
            return
        bm = self.block_manager
        bm.append_slots(seq, k)
        seq.num_computed_tokens += k
        n = seq.num_output_tokens
        seq.token_ids.extend(self.outputs(seq.request_id)[n : n + k])
        published = bm.cache_full_blocks(seq)
        if published and self.tiering is not None:
            self._pend_saves(seq, published, upto - k, seq.num_computed_tokens - k)
        self._base[seq] = upto

    def _pend_saves(
        self, seq: Sequence, published: list[tuple[int, BlockHash]], base: int, computed: int
    ) -> None:
        """File the blocks ``seq`` completed since step ``base`` (``computed`` tokens then)
        under the step each completed at: ``_save_in_order`` hands them to the tiers as the
        real engine would have, step by step, in running order."""
        bs, order = self.block_manager.block_size, self._order[seq]
        first = len(seq.block_hashes) - len(published)
        for i, (block_id, block_hash) in enumerate(published, first):
            self._saves.append((base + (i + 1) * bs - computed, order, block_id, block_hash))

    def _save_in_order(self) -> None:
        assert self.tiering is not None
        self._saves.sort(key=lambda s: (s[0], s[1]))
        self.tiering.on_cached([(block_id, h) for _, _, block_id, h in self._saves])
        self._saves.clear()

    def _live(self, entry: tuple[int, int, Sequence], kind: int) -> bool:
        due = self._due.get(entry[2])
        return due is not None and due[kind] == entry[1]

    def _next_finish(self) -> int:
        while self._finishes and not self._live(self._finishes[0], 1):
            heapq.heappop(self._finishes)
        return self._finishes[0][0]

    def _schedule(self, seq: Sequence) -> None:
        """File the step at which ``seq`` needs its next block."""
        base, c = self._base[seq], seq.num_computed_tokens
        cap = len(seq.block_table) * self.block_manager.block_size
        self._tick += 1
        self._due[seq][0] = self._tick
        heapq.heappush(self._crossings, (base + cap - c + 1, self._tick, seq))

    def _file_finish(self, seq: Sequence) -> None:
        """File the step after which ``seq`` stops (its length limits; sim requests ignore
        EOS). It never moves: each step adds one output token and one step alike."""
        left = min(
            seq.params.max_tokens - seq.num_output_tokens,
            self.config.max_model_len - seq.num_tokens,
        )
        self._tick += 1
        self._due[seq] = [0, self._tick]
        heapq.heappush(self._finishes, (self._base[seq] + left, self._tick, seq))

    def _promote(self) -> None:
        """Sequences that finished their prefill join the decoding front, up to date now."""
        if self.exact:
            return
        running = self.scheduler.running
        i = self._n_dec
        while i < len(running) and decoding(running[i]):
            seq = running[i]
            self._base[seq] = self.steps
            self._ctx_base += seq.num_computed_tokens - self.steps
            self._file_finish(seq)
            self._order[seq] = self._tick
            self._schedule(seq)
            i += 1
        self._n_dec = i

    def _retire(self, seq: Sequence) -> None:
        del self._due[seq]
        del self._order[seq]
        self._ctx_base -= seq.num_computed_tokens - self._base.pop(seq)
        self._n_dec -= 1

    def _demote_all(self) -> None:
        """Hand every decoding sequence back to the real scheduler, up to date."""
        for seq in self.scheduler.running[: self._n_dec]:
            self._materialize(seq, self.steps)
        if self._saves:
            self._save_in_order()
        self._base.clear()
        self._order.clear()
        self._due.clear()
        self._crossings.clear()
        self._finishes.clear()
        self._ctx_base = 0
        self._n_dec = 0


def decoding(seq: Sequence) -> bool:
    """Past its prefill: one uncomputed token, and the first token already reported (a prompt
    whose chunk stopped one short of its end still samples its first token in a real step)."""
    return seq.num_uncomputed_tokens == 1 and seq.num_output_tokens > 0
