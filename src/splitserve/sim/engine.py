"""One simulated engine: the real ``Scheduler`` and ``BlockManager``, a cost model in place of
the model runner, and decode steps taken in bulk.

Every admission, prefix-cache match, chunked prefill and preemption is the real scheduler's
decision. What is done here instead is the one part of a step that is fully determined: a
sequence past its prefill takes one token per step. Such *decoding* sequences always sit at
the front of ``scheduler.running`` (admitted first, so their prefill finished first), so the
real loop serves them first, one token each, and gives the rest of the budget to the others::

    scheduler.running = [ d d d d d | p p ]      waiting = [ w w ]
                          decoding    prefilling
                          (here, lazily)  (the real schedule()/update() on this tail)

Decoding sequences are advanced lazily: each remembers the step it was last brought up to
date (``_base``), and is touched again only when it needs a new KV block, finishes, or the
real scheduler must see it (preemption). When nothing else can run (no prefill, no
admission possible), a whole run of decode steps is taken at once, its time summed in closed
form (``DecodeLine``). ``exact=True`` runs every step through the real ``schedule()`` and
``update()`` instead; the tests check both give the same timings.

With lower KV tiers (``sim/tiers.py``) the real scheduler consults the real ``Tiering`` at
admission, as in the real engine. Blocks that lazily advanced sequences completed are
handed to the tiers at the end of each step or run, in the order the real engine saves
them (by the step they completed at, then running order), so the tiers' LRU order is the
same as when stepping exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass

from splitserve.common.kv_hash import BlockChain, BlockHash
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.plan import StepPlan, StepResult
from splitserve.engine.scheduler import Scheduler, SchedulerConfig, SequenceUpdate
from splitserve.engine.sequence import Sequence
from splitserve.sim.cost_model import CostModel, DecodeLine, StepShape
from splitserve.sim.lazy_decodes import LazyDecodes, StepReport
from splitserve.sim.step_log import StepLog
from splitserve.sim.tiers import SimLadder, SimTiering, TierLoad


@dataclass(slots=True)
class _Run:
    steps: int
    line: DecodeLine


class SimEngine(LazyDecodes):
    """``outputs(request_id)`` gives the token ids a request generates, in order."""

    def __init__(
        self,
        cost: CostModel,
        config: SchedulerConfig,
        num_blocks: int,
        block_size: int,
        outputs: Callable[[str], Sequence_[int]],
        exact: bool = False,
        log_steps: bool = False,
        tiers: SimLadder | None = None,
    ) -> None:
        if config.max_num_seqs > config.max_num_batched_tokens:
            raise ValueError("max_num_seqs must not exceed max_num_batched_tokens")
        self.cost = cost
        self.config = config
        self.block_manager = BlockManager(num_blocks, block_size)
        # Lower KV tiers: the real policy, consulted by the real scheduler at admission.
        self.tiering = None if tiers is None else SimTiering(self.block_manager, tiers)
        self.scheduler = Scheduler(
            dataclasses.replace(config),  # its own: a decode run narrows the budget
            self.block_manager,
            self.tiering,
        )
        self.outputs = outputs
        self.exact = exact
        self.step_log = StepLog() if log_steps else None
        self._duration = 0.0
        self.steps = 0  # steps taken; a decoding sequence is up to date at ``_base[seq]``
        self._n_dec = 0  # scheduler.running[:_n_dec] are decoding
        self._base: dict[Sequence, int] = {}
        self._order: dict[Sequence, int] = {}
        self._ctx_base = 0  # sum over decoding of (computed - base): contexts in O(1)
        # (step, tick, seq): the step at which seq needs a new block / finishes. An entry is
        # live while its tick is the one _due holds for seq.
        self._crossings: list[tuple[int, int, Sequence]] = []
        self._finishes: list[tuple[int, int, Sequence]] = []
        self._due: dict[Sequence, list[int]] = {}  # seq -> [crossing tick, finish tick]
        self._tick = 0
        self._blocked = False  # admission failed and nothing has freed blocks since
        self._plan: StepPlan | None = None
        self._run: _Run | None = None
        # Blocks decoding sequences completed, waiting to be saved down the tiers in order:
        # (step, running order, block id, hash).
        self._saves: list[tuple[int, int, int, BlockHash]] = []

    # ---- requests ------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)
        self._blocked = False

    def blocks_released(self) -> None:
        """Blocks went back to the pool from outside (a lease ended): admission may succeed."""
        self._blocked = False

    @property
    def in_run(self) -> bool:
        return self._run is not None

    def spare_blocks(self, blocks: int) -> bool:
        """Whether ``blocks`` blocks can leave the pool now without taking one the decode run
        in progress still needs (a run takes its new blocks only at its end; a single step
        took its own when it began)."""
        need = 0 if self._run is None else self._blocks_for(self._run.steps)
        return need + blocks <= self.block_manager.num_free_blocks

    # ---- KV from outside: a pull, the lower tiers ----------------------------------------

    def register(
        self, block_ids: list[int], hashes: list[BlockHash], chain: BlockChain, start: int
    ) -> None:
        """Publish pulled blocks, ``start, start + 1, ...`` of ``chain`` (which covers them),
        stored with the chain's own token tuples; like computed ones, they are saved down
        the tiers."""
        end = start + len(block_ids)
        self.block_manager.register(block_ids, hashes, [], start, chain.tokens[start:end])
        if self.tiering is not None:
            self.tiering.on_cached(list(zip(block_ids, hashes, strict=True)))
        self._blocked = False

    def take_loads(self) -> list[TierLoad]:
        """Tier loads the last step's admissions (or a prefetch) started."""
        return [] if self.tiering is None else self.tiering.take_loads()

    def land(self, load: TierLoad) -> None:
        """A tier load finished: its sequences go back to the front of the queue."""
        assert self.tiering is not None, "a load landed on a worker without tiers"
        for seq in reversed(self.tiering.land(load)):
            self.scheduler.resume(seq)
        self._blocked = False

    # ---- stepping ------------------------------------------------------------------------

    def begin(self) -> float | None:
        """Start the next step (or run of decode steps); its duration, None when idle."""
        running = self.scheduler.running
        if self.exact:
            self._demote_all()
        if running and self._n_dec == len(running) and not self._can_admit():
            return self._begin_run()
        if not self._allocate_decode_step():
            self._demote_all()
        plan = self._schedule_tail()
        if not plan and not self._n_dec:
            return None
        self._plan = plan
        self._duration = self.cost.step_time(self._shape(plan))
        return self._duration

    def interrupt(self, elapsed: float) -> float | None:
        """Something arrived ``elapsed`` seconds into the current run: end the run after the
        step in progress. Returns the run's new duration (None: not in a run)."""
        run = self._run
        if run is None:
            return None
        done = run.line.steps_within(elapsed, run.steps)
        run.steps = min(run.steps, done + 1)
        return run.line.total(run.steps)

    def end(self) -> StepReport:
        """Apply the step (or run) begun last; what it produced."""
        report = StepReport()
        if self._run is not None:
            steps, line, self._run = self._run.steps, self._run.line, None
            if self.step_log is not None:
                self.step_log.add_run(self.steps, steps, line)
            self._advance(self.steps + steps, report)
            return report
        plan, self._plan = self._plan, None
        assert plan is not None, "end() without a begun step"
        if self.step_log is not None:
            self.step_log.add_step(self.steps, self._duration)
        self._advance(self.steps + 1, report)
        updates = self._update_tail(plan)
        for u in updates:
            if u.new_token is not None and u.seq.num_output_tokens == 1:
                report.first_tokens.append(u.seq)
            if u.finished:
                report.finished.append(u.seq)
        if report.finished:
            self._blocked = False
        self._promote()
        return report

    # ---- the real scheduler on the prefilling tail ---------------------------------------

    def _schedule_tail(self) -> StepPlan:
        s, n = self.scheduler, self._n_dec
        head, s.running = s.running[:n], s.running[n:]
        budget = self.config.max_num_batched_tokens - n
        s.config.max_num_seqs = self.config.max_num_seqs - n
        s.config.max_num_batched_tokens = budget
        preemptions = s.num_preemptions
        try:
            plan = s.schedule()
        finally:
            s.running = head + s.running
        # Admission stopped for want of blocks (not of budget, seats or a preemption): it
        # stays stopped until something frees blocks, as decode steps only take more.
        self._blocked = (
            bool(s.waiting)
            and s.num_preemptions == preemptions
            and len(s.running) < self.config.max_num_seqs
            and plan.num_tokens < budget
        )
        return plan

    def _update_tail(self, plan: StepPlan) -> list[SequenceUpdate]:
        s, n = self.scheduler, self._n_dec
        head, s.running = s.running[:n], s.running[n:]
        try:
            out = self.outputs
            sampled = {
                c.request_id: out(c.request_id)[c.num_output_tokens]
                for c in plan.chunks
                if c.sample
            }
            return s.update(plan, StepResult(sampled))
        finally:
            s.running = head + s.running

    def admission_possible(self) -> bool:
        return self._can_admit()

    def _can_admit(self) -> bool:
        """Whether the real scheduler could admit a waiting sequence next step (all running
        sequences decoding, so they take one token each of the budget)."""
        s = self.scheduler
        if not s.waiting or self._blocked:
            return False
        n = len(s.running)
        return n < self.config.max_num_seqs and n < self.config.max_num_batched_tokens

    def _shape(self, plan: StepPlan) -> StepShape:
        b = self._n_dec
        ctx = self._ctx_base + b * (self.steps + 1)
        tokens, sampled, attended, kv_read = b, b, float(ctx), ctx
        for c in plan.chunks:
            n, s = c.num_tokens, c.start_pos
            tokens += n
            sampled += c.sample
            attended += n * s + n * (n + 1) / 2
            kv_read += s + n
        return StepShape(tokens, sampled, attended, kv_read, b + len(plan.chunks))

    # ---- decoding sequences, lazily ------------------------------------------------------

    def _begin_run(self) -> float:
        b = self._n_dec
        steps = self._block_limited(max(1, self._next_finish() - self.steps))
        if steps == 0:  # not even one step's blocks: the real scheduler preempts
            self._demote_all()
            plan = self._schedule_tail()
            self._plan = plan
            self._duration = self.cost.step_time(self._shape(plan))
            return self._duration
        ctx = self._ctx_base + b * (self.steps + 1)
        line = self.cost.decode_line(b, ctx)
        self._run = _Run(steps, line)
        return line.total(steps)
