"""How many of this process's CPUs other processes leave free, for choosing a step's threads.

A multi-threaded kernel joins its threads many times per step (the fused decode step: five
times per layer); when another process holds one of the cores, every join waits for the
descheduled thread's next time slice and a 30 ms step turns into hundreds of ms. One thread
then is the faster choice. The share is sampled from the kernel's CPU counters: time the
process's CPUs were busy, minus the time this process itself ran, over the last interval::

    others = (busy(cpus) - cpu_time(self)) / wall       (in cores)
    threads = clamp(round(len(cpus) - others), 1, max_threads)
"""

from __future__ import annotations

import os
import time

import psutil


class CoreShare:
    """``threads(max_threads)``: how many threads a step should use now. Samples at most once
    per ``interval_s`` (a sample reads /proc/stat, tens of microseconds)."""

    def __init__(self, interval_s: float = 0.25) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.cpus = sorted(os.sched_getaffinity(0))
        self.process = psutil.Process()
        self.others = 0.0  # cores busy with other processes over the last interval
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, float]:
        per_cpu = psutil.cpu_times(percpu=True)
        busy = 0.0
        for cpu in self.cpus:
            if cpu < len(per_cpu):
                t = per_cpu[cpu]
                busy += sum(t) - t.idle - getattr(t, "iowait", 0.0)
        own = self.process.cpu_times()
        return time.monotonic(), busy, own.user + own.system

    def threads(self, max_threads: int) -> int:
        now = time.monotonic()
        if now - self._last[0] >= self.interval_s:
            sample = self._sample()
            wall = sample[0] - self._last[0]
            busy, own = sample[1] - self._last[1], sample[2] - self._last[2]
            self.others = max(0.0, (busy - own) / wall)
            self._last = sample
        free = len(self.cpus) - self.others
        return max(1, min(max_threads, int(free + 0.5)))
