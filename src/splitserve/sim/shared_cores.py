"""Workers of one thread each sharing a host's cores (``SimConfig.host_cores``).

``bench compare --cores 4 --threads-per-worker 1`` runs four one-thread workers on this
machine's two cores, and a ``cpu-local`` calibration is the speed of one thread alone. This
is processor sharing: while ``k`` workers compute on ``n`` cores, each runs at
``min(1, n / k)`` of its speed, and ``min(k, n)`` engines computing at once slow each other
by ``co_run_slowdown`` for each one more (memory bandwidth and caches are shared too;
``sim calibrate --co-run`` measures it). When ``k`` changes, every step in progress goes on
at the new rate from then on, and a decode run ends after its current step.
"""

from __future__ import annotations

from collections.abc import Callable

from splitserve.sim.state import SimWorker


class SharedCores:
    def __init__(
        self,
        cores: int,
        co_run_slowdown: float,
        workers: list[SimWorker],
        schedule_end: Callable[[SimWorker, float], None],
    ) -> None:
        self.cores = cores
        self.co_run_slowdown = co_run_slowdown
        self.workers = workers
        self._schedule_end = schedule_end  # (worker, wall seconds from its step's start)

    def start(self, w: SimWorker, work: float, was_busy: bool, now: float) -> None:
        """``w`` starts a step (or run) of ``work`` engine seconds; ``w.busy`` is set."""
        w.work, w.done, w.mark = work, 0.0, now
        if not was_busy:
            self._reshare(w, now)
        w.stretch = self._stretch()
        self._schedule(w)

    def stopped(self, w: SimWorker, now: float) -> None:
        """``w`` went idle; ``w.busy`` is cleared."""
        self._reshare(w, now)

    def cut_run(self, w: SimWorker, now: float) -> None:
        """End ``w``'s decode run after the step in progress."""
        total = w.engine.interrupt(w.done + (now - w.mark) / w.stretch)
        if total is not None and total < w.work:
            w.work = total
            self._schedule(w)

    def _stretch(self) -> float:
        """Wall seconds per engine second now: the share of a core, ``max(1, k / n)``, times
        the slowdown of ``min(k, n)`` engines computing at once."""
        n, k = self.cores, sum(1 for x in self.workers if x.busy)
        return max(1.0, k / n) * (1.0 + self.co_run_slowdown * (min(k, n) - 1))

    def _schedule(self, w: SimWorker) -> None:
        self._schedule_end(w, w.mark + (w.work - w.done) * w.stretch - w.started)

    def _reshare(self, changed: SimWorker, now: float) -> None:
        """Every other busy worker's step goes on at the new rate."""
        stretch = self._stretch()
        for x in self.workers:
            if x is changed or not x.busy:
                continue
            x.done += (now - x.mark) / x.stretch
            x.mark, x.stretch = now, stretch
            if x.engine.in_run:
                total = x.engine.interrupt(x.done)
                if total is not None:
                    x.work = min(x.work, total)
            self._schedule(x)
