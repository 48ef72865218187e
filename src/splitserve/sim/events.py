"""The event queue: handlers and their arguments, called in order of (time, scheduling order).

Ties in time resolve in the order events were scheduled, so a run is a pure function of its
inputs: the same workload and seed give the same trace, event for event.

The heap holds each pending time once, as a bare float; the events due at a time wait in
one list, in the order they were scheduled (an event scheduled for the time being run joins
the end of its list, after every event already due then)::

    _times (heap):  [4.0, 7.5, 9.25 ...]
    _due:           {4.0: [h1, a1, h2, a2], 7.5: [h3, a3], ...}

This orders events exactly as a heap of (time, sequence number) tuples would, with float
comparisons in place of tuple comparisons (the heap's sifts were most of its cost).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class EventQueue:
    def __init__(self) -> None:
        self._times: list[float] = []
        self._due: dict[float, list[Any]] = {}  # handler, argument, handler, argument ...
        self._count = 0
        self._pending = 0
        self.now = 0.0
        self.processed = 0

    def at(self, time: float, handler: Callable[[Any], None], arg: Any = None) -> None:
        """Call ``handler(arg)`` at ``time`` (never before now)."""
        self._count += 1
        self._pending += 1
        if time < self.now:
            time = self.now
        due = self._due.get(time)
        if due is None:
            self._due[time] = [handler, arg]
            heapq.heappush(self._times, time)
        else:
            due.append(handler)
            due.append(arg)

    def run(self) -> None:
        times, pending, pop = self._times, self._due, heapq.heappop
        while times:
            time = pop(times)
            self.now = time
            due = pending[time]
            i = 0
            while i < len(due):  # grows while it runs: events scheduled for now
                handler, arg = due[i], due[i + 1]
                i += 2
                self._pending -= 1
                handler(arg)
            del pending[time]
        self.processed = self._count

    def __len__(self) -> int:
        return self._pending
