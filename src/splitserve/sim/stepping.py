"""Stepping the simulated workers' engines, as the real worker's engine thread does.

A worker's engine is touched from outside (KV reserved, registered, a lease released) only
between steps: such calls queue (``on_engine``) until the step in progress ends, or run at
once while a decode run is cut short (``on_engine_now``). Each step's end is an event; a
decode run may be cut after its current step when work arrives that it could admit.
"""

from __future__ import annotations

from collections.abc import Callable

from splitserve.sim.cost_model import CostModel
from splitserve.sim.deployment import SimConfig
from splitserve.sim.engine import StepReport
from splitserve.sim.events import EventQueue
from splitserve.sim.shared_cores import SharedCores
from splitserve.sim.state import SimStats, SimWorker
from splitserve.sim.tiers import TierLoad


class Stepping:
    """The stepping half of ``cluster.Cluster``, which sets these attributes and handles
    each step's outcome (``_handle``)."""

    config: SimConfig
    cost: CostModel
    events: EventQueue
    stats: SimStats
    cores: SharedCores | None

    @property
    def now(self) -> float:
        return self.events.now

    def _handle(self, w: SimWorker, report: StepReport) -> None:
        raise NotImplementedError

    def on_engine_now(self, w: SimWorker, call: Callable[[], None], blocks: int) -> None:
        """Run ``call`` on ``w``'s engine as the real worker's ``call_now`` runs it (the KV
        pull's lookups, reserves and registers, a peer's lease): under the engine's lock,
        while a model run is in progress, not after it. A decode run in progress is cut
        after its current step, whose blocks stay its own: when ``call`` could take more
        blocks than the pool holds beyond them (``blocks``, an upper bound), or ``w`` has
        lower tiers (whose save order a call amid a run would change), it waits for the
        step boundary, as ``on_engine``."""
        if w.in_calls:
            call()  # between steps already
            return
        if not w.busy or w.engine.tiering is not None:
            self.on_engine(w, call)
            return
        if w.engine.in_run:
            self._cut_run(w)
        if w.engine.spare_blocks(blocks):
            call()
        else:
            self.on_engine(w, call)

    def _kick(self, w: SimWorker) -> None:
        """Something changed for ``w``: start a step if idle, or end a decode run early."""
        if w.in_calls:
            return  # between steps already: _begin picks it up
        if not w.busy:
            self._begin(w)
        elif w.engine.in_run and (w.calls or w.engine.admission_possible()):
            self._cut_run(w)

    def _cut_run(self, w: SimWorker) -> None:
        """End ``w``'s decode run after the step in progress."""
        if self.cores is not None:
            self.cores.cut_run(w, self.now)
            return
        total = w.engine.interrupt(self.now - w.started)
        if total is not None and total < w.duration:
            self._schedule_end(w, total)

    def _begin(self, w: SimWorker) -> None:
        """Between steps: run the queued engine calls, then start the next step. A call
        queued by a call waits for the next step boundary, unless the engine is idle."""
        was_busy = w.busy
        while True:
            calls, w.calls = w.calls, []
            w.in_calls = True
            for call in calls:
                call()
            w.in_calls = False
            duration = w.engine.begin()
            if w.engine.tiering is not None:
                self._start_loads(w)
            if duration is not None and w.calls and w.engine.in_run:
                duration = w.engine.interrupt(0.0)  # the queued calls wait one step only
            if duration is not None:
                w.busy = True
                w.started = self.now
                if self.cores is not None:
                    self.cores.start(w, duration, was_busy, self.now)
                else:
                    self._schedule_end(w, duration)
                return
            if not w.calls:
                w.busy = False
                if self.cores is not None and was_busy:
                    self.cores.stopped(w, self.now)
                return

    def _schedule_end(self, w: SimWorker, duration: float) -> None:
        w.duration = duration
        w.version += 1
        self.events.at(w.started + duration, self._step_ends, (w, w.version))

    def _step_ends(self, arg: tuple[SimWorker, int]) -> None:
        w, version = arg
        if version != w.version:
            return  # superseded: the run was cut short
        w.busy_s += w.duration
        w.engine_s += w.duration if self.cores is None else w.work
        w.steps += 1
        report = w.engine.end()
        self._handle(w, report)
        if self.cores is not None:
            self.cores.step_ended(w, self.now)
        self._begin(w)

    def _start_loads(self, w: SimWorker) -> None:
        """Queue the tier loads ``w``'s engine just decided on its mover, one after another;
        each lands at the step boundary after it ends."""
        bs = self.config.block_size
        for load in w.engine.take_loads():
            start = max(self.now, w.mover_free)
            w.mover_free = start + self.cost.tier_load_time(
                load.host_blocks * bs, load.disk_blocks * bs
            )
            s = self.stats
            s.tier_loads += 1
            s.tier_blocks_host += load.host_blocks
            s.tier_blocks_disk += load.disk_blocks
            self.events.at(w.mover_free, self._loaded, (w, load))

    def _loaded(self, arg: tuple[SimWorker, TierLoad]) -> None:
        w, load = arg
        self.on_engine(w, lambda: w.engine.land(load))

    def on_engine(self, w: SimWorker, call: Callable[[], None]) -> None:
        """Run ``call`` on ``w``'s engine between steps."""
        w.calls.append(call)
        self._kick(w)
