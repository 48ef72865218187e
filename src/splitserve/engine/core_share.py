"""How many threads a multi-threaded step should use, given what other processes leave free.

A multi-threaded kernel joins its threads many times per step (the fused decode step: five
times per layer); when another process holds one of the cores, every join may wait for the
descheduled thread's next time slice, and a 30 ms step turns into hundreds of ms. One thread
then is the faster choice. The share is sampled from the kernel's CPU counters: time the
process's CPUs were busy, minus the time this process itself ran, over the last interval::

    others = (busy(cpus) - cpu_time(self)) / wall       (in cores)
    free = round(len(cpus) - others)

With ``free >= max_threads`` a step gets all its threads. With fewer free, whether the threads
still pay depends on the other process (one at a lower priority, e.g. ``nice``, yields its
core at once), so the steps' own times decide: they run on ``free`` threads, and now and then
one probes ``max_threads``; a probe faster than the recent few-thread steps lets every step
use ``max_threads`` until one is slower, a slower probe doubles the wait to the next (up to
``max_probe_s``), so a bad probe costs a bounded share of the time.
"""

from __future__ import annotations

import os
import time

import psutil


class CoreShare:
    """``threads(max_threads)``: how many threads a step should use now. Samples at most once
    per ``interval_s`` (a sample reads /proc/stat, tens of microseconds)."""

    def __init__(
        self, interval_s: float = 0.25, probe_s: float = 1.0, max_probe_s: float = 32.0
    ) -> None:
        if not (0 < interval_s and 0 < probe_s <= max_probe_s):
            raise ValueError(
                f"need interval_s > 0 and 0 < probe_s <= max_probe_s, got {interval_s}, "
                f"{probe_s}, {max_probe_s}"
            )
        self.interval_s, self.probe_s, self.max_probe_s = interval_s, probe_s, max_probe_s
        self.cpus = sorted(os.sched_getaffinity(0))
        self.process = psutil.Process()
        self.others = 0.0  # cores busy with other processes over the last interval
        self._last = self._sample()
        self.few_s: float | None = None  # recent time of a step on fewer threads (EMA)
        self.many_pays = False  # all threads measured faster despite the other processes
        self._probe_wait = probe_s
        self._next_probe = 0.0

    def _sample(self) -> tuple[float, float, float]:
        per_cpu = psutil.cpu_times(percpu=True)
        busy = 0.0
        for cpu in self.cpus:
            if cpu < len(per_cpu):
                t = per_cpu[cpu]
                busy += sum(t) - t.idle - getattr(t, "iowait", 0.0)
        own = self.process.cpu_times()
        return time.monotonic(), busy, own.user + own.system

    def free(self) -> int:
        """CPUs other processes left free over the last interval (at least 1)."""
        now = time.monotonic()
        if now - self._last[0] >= self.interval_s:
            sample = self._sample()
            wall = sample[0] - self._last[0]
            busy, own = sample[1] - self._last[1], sample[2] - self._last[2]
            self.others = max(0.0, (busy - own) / wall)
            self._last = sample
        return max(1, int(len(self.cpus) - self.others + 0.5))

    def threads(self, max_threads: int) -> int:
        """Threads for the next step; report its time with ``record``."""
        free = self.free()
        if free >= max_threads or self.many_pays:
            return max_threads
        if self.few_s is not None and time.monotonic() >= self._next_probe:
            return max_threads  # a probe
        return free

    def record(self, threads: int, max_threads: int, seconds: float) -> None:
        """The time of a step run on ``threads`` of ``max_threads``."""
        if threads < max_threads:
            self.few_s = seconds if self.few_s is None else 0.8 * self.few_s + 0.2 * seconds
        elif self.few_s is not None and self.free() < max_threads:
            self.many_pays = seconds < 0.9 * self.few_s
            if self.many_pays:
                self._probe_wait = self.probe_s
            else:
                self._next_probe = time.monotonic() + self._probe_wait
                self._probe_wait = min(2 * self._probe_wait, self.max_probe_s)
