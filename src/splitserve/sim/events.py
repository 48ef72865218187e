"""The event queue: a heap of (time, sequence number, handler, argument).

Ties in time resolve in the order events were scheduled, so a run is a pure function of its
inputs: the same workload and seed give the same trace, event for event.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class EventQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._count = 0
        self.now = 0.0
        self.processed = 0

    def at(self, time: float, handler: Callable[[Any], None], arg: Any = None) -> None:
        """Call ``handler(arg)`` at ``time`` (never before now)."""
        self._count += 1
        heapq.heappush(self._heap, (max(time, self.now), self._count, handler, arg))

    def run(self) -> None:
        heap, pop = self._heap, heapq.heappop
        while heap:
            time, _, handler, arg = pop(heap)
            self.now = time
            handler(arg)
        self.processed = self._count

    def __len__(self) -> int:
        return len(self._heap)
