"""Every step a simulated worker took, for the requests' inter-token gaps."""

from __future__ import annotations

import bisect

from splitserve.sim.cost_model import DecodeLine


class StepLog:
    """Every step's duration, kept as runs (a ``DecodeLine``) and single steps, to give a
    request its inter-token gaps: the durations of the steps it took part in."""

    def __init__(self) -> None:
        self._starts: list[int] = []  # index of each entry's first step (0-based)
        self._entries: list[tuple[int, float | DecodeLine]] = []  # (steps, duration or line)

    def add_step(self, first: int, duration: float) -> None:
        self._starts.append(first)
        self._entries.append((1, duration))

    def add_run(self, first: int, steps: int, line: DecodeLine) -> None:
        self._starts.append(first)
        self._entries.append((steps, line))

    def durations(self, lo: int, hi: int) -> list[float]:
        """Durations of steps ``lo .. hi - 1``."""
        out: list[float] = []
        i = max(0, bisect.bisect_right(self._starts, lo) - 1)
        while i < len(self._entries) and self._starts[i] < hi:
            first, (n, what) = self._starts[i], self._entries[i]
            a, b = max(lo, first), min(hi, first + n)
            if isinstance(what, float):
                out.extend([what] * (b - a))
            else:
                out.extend(what.step(k - first) for k in range(a, b))
            i += 1
        return out
