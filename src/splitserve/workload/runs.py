"""A load to drive a workload at, and what one run at it gave (measured or simulated)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from splitserve.workload.metrics import RequestRecord, Summary


class RunResult(NamedTuple):
    summary: Summary
    records: list[RequestRecord]


@dataclass(frozen=True, slots=True)
class Load:
    rate: float | None = None  # sessions per second, open loop
    concurrency: int | None = None  # sessions in flight, closed loop
    duration_s: float = 60.0
    drain_s: float = 120.0

    def __post_init__(self) -> None:
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError("give exactly one of a rate and a concurrency")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"the rate must be > 0, got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"the concurrency must be >= 1, got {self.concurrency}")
        if not self.duration_s > 0 or self.drain_s < 0:
            raise ValueError("the duration must be > 0 and the drain time >= 0")

    def describe(self) -> str:
        how = (
            f"rate {self.rate:g}/s" if self.rate is not None else f"concurrency {self.concurrency}"
        )
        return f"{how}, {self.duration_s:g} s"
