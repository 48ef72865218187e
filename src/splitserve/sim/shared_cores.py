"""Workers of one thread each sharing a host's cores (``SimConfig.host_cores``).

``bench compare --cores 4 --threads-per-worker 1`` runs four one-thread workers on this
machine's two cores, and a ``cpu-local`` calibration is the speed of one thread alone. This
is processor sharing: while ``k`` workers compute on ``n`` cores, each runs at
``min(1, n / k)`` of its speed, and ``min(k, n)`` engines computing at once slow each other
by ``co_run_slowdown`` for each one more (memory bandwidth and caches are shared too;
``sim calibrate --co-run`` measures it). When ``k`` changes, every step in progress goes on
at the new rate from then on, and a decode run ends after its current step.

The same cores also run what serves the requests outside the engines: HTTP, chat
templates, tokenizing, streams through the router to the client
(``serving_cpu_per_request_s`` when a request arrives, ``serving_cpu_per_token_s`` for each
token it generated when it ends, ``kv_copy_cpu_per_block_s`` for each block a worker's KV
mover saves to or loads from a lower tier; ``benchmarks/serving_cpu.py`` measures all
three). That work queues as a backlog which, while there is any, computes as one more
thread in the share.
"""

from __future__ import annotations

from collections.abc import Callable

from splitserve.sim.events import EventQueue
from splitserve.sim.state import SimWorker


class SharedCores:
    def __init__(
        self,
        cores: int,
        co_run_slowdown: float,
        kv_copy_cpu_per_block_s: float,
        workers: list[SimWorker],
        schedule_end: Callable[[SimWorker, float], None],
        events: EventQueue,
    ) -> None:
        self.cores = cores
        self.co_run_slowdown = co_run_slowdown
        self.kv_copy_cpu_per_block_s = kv_copy_cpu_per_block_s
        self._tier_blocks: dict[str, int] = {}  # a worker's blocks saved + loaded so far
        self.workers = workers
        self._schedule_end = schedule_end  # (worker, wall seconds from its step's start)
        self._events = events
        self.backlog = 0.0  # serving CPU seconds not yet done
        self.serving_s = 0.0  # serving CPU seconds queued in all
        self._backlog_mark = 0.0
        self._backlog_rate = 1.0  # CPU seconds per wall second while it lasts
        self._backlog_version = 0

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

    def step_ended(self, w: SimWorker, now: float) -> None:
        """The KV mover's copies of the blocks ``w``'s tiers saved or loaded since its last
        step are serving work."""
        tiering = w.engine.tiering
        if tiering is None or not self.kv_copy_cpu_per_block_s:
            return
        moved = tiering.stats.blocks_saved + tiering.stats.blocks_loaded
        new = moved - self._tier_blocks.get(w.name, 0)
        self._tier_blocks[w.name] = moved
        self.serve(new * self.kv_copy_cpu_per_block_s, now)

    def serve(self, cpu_s: float, now: float) -> None:
        """``cpu_s`` seconds of serving work join the backlog, once the event in progress
        is done (a worker may be between steps); a backlog that starts slows every busy
        worker."""
        if cpu_s > 0.0:
            self.serving_s += cpu_s
            self._events.at(now, self._queue, cpu_s)

    def _queue(self, cpu_s: float) -> None:
        now = self._events.now
        if self.backlog > 0.0:
            self._drain(now)
            self.backlog += cpu_s
            self._schedule_backlog(now)
        else:
            self.backlog = cpu_s
            self._backlog_mark = now
            self._reshare(None, now)

    def _backlog_done(self, version: int) -> None:
        if version == self._backlog_version:
            self.backlog = 0.0
            self._reshare(None, self._events.now)

    def _share(self) -> tuple[int, float]:
        """(workers computing, a core's share for each computing thread)."""
        k = sum(1 for x in self.workers if x.busy)
        threads = k + (1 if self.backlog > 0.0 else 0)
        return k, max(1.0, threads / self.cores)

    def _stretch(self) -> float:
        """Wall seconds per engine second now: the share of a core, ``max(1, k / n)``, times
        the slowdown of ``min(k, n)`` engines computing at once."""
        k, share = self._share()
        return share * (1.0 + self.co_run_slowdown * (min(k, self.cores) - 1))

    def _schedule(self, w: SimWorker) -> None:
        self._schedule_end(w, w.mark + (w.work - w.done) * w.stretch - w.started)

    def _drain(self, now: float) -> None:
        self.backlog -= (now - self._backlog_mark) * self._backlog_rate
        self._backlog_mark = now

    def _schedule_backlog(self, now: float) -> None:
        self._backlog_rate = 1.0 / self._share()[1]
        self._backlog_version += 1
        end = now + max(0.0, self.backlog) / self._backlog_rate
        self._events.at(end, self._backlog_done, self._backlog_version)

    def _reshare(self, changed: SimWorker | None, now: float) -> None:
        """Every other busy worker's step, and the serving backlog, go on at the new rate."""
        if self.backlog > 0.0:
            self._drain(now)
            self._schedule_backlog(now)
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
