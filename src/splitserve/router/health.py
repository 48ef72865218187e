"""Per-worker circuit breakers and the loop that probes ``/health`` and ``/load``.

::

            K consecutive failures            cool-down elapsed
    CLOSED ────────────────────────▶ OPEN ─────────────────────▶ HALF_OPEN
      ▲                               ▲                              │
      └────────── a success ──────────┼──────────────────────────────┤
                                      └────────── a failure ─────────┘

A worker takes requests while CLOSED or HALF_OPEN (the trial); OPEN keeps it out of every
ring, which moves only its own sessions. Both the probe loop and the proxy report outcomes,
so a dead worker is dropped on the first requests that hit it, not a probe interval later.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from splitserve.router.worker import LoadReport, Worker

log = logging.getLogger(__name__)


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(slots=True)
class CircuitBreaker:
    """Opens after ``failure_threshold`` consecutive failures; retries after ``cooldown_s``."""

    failure_threshold: int = 3
    cooldown_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    state: BreakerState = BreakerState.CLOSED
    failures: int = 0
    opened_at: float = field(default=0.0)

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {self.failure_threshold}")
        if self.cooldown_s < 0:
            raise ValueError(f"cooldown_s must be >= 0, got {self.cooldown_s}")

    def allows(self) -> bool:
        """Whether the worker may take a request now (moves OPEN to HALF_OPEN when due)."""
        if self.state is BreakerState.OPEN and self.clock() - self.opened_at >= self.cooldown_s:
            self.state = BreakerState.HALF_OPEN
        return self.state is not BreakerState.OPEN

    def record_success(self) -> None:
        self.failures = 0
        self.state = BreakerState.CLOSED

    def record_failure(self) -> None:
        self.failures += 1
        # A failed trial reopens at once: the worker already proved itself unreliable.
        if self.state is BreakerState.HALF_OPEN or self.failures >= self.failure_threshold:
            self.state = BreakerState.OPEN
            self.opened_at = self.clock()


class HealthChecker:
    """Probes every worker on an interval; outcomes go to ``report`` (the membership).

    ``report(url, ok, load, own)``: ``ok`` is False on a connection error, a timeout or a
    non-200 ``/health``; ``load`` is the parsed ``/load`` when it answered, and ``own`` the
    most requests this router had in flight there while ``/load`` was asked.
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        workers: Callable[[], list[Worker]],
        report: Callable[[str, bool, LoadReport | None, int], None],
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.client = client
        self.workers = workers
        self.report = report
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.headers = headers or {}
        self._task: asyncio.Task | None = None

    async def probe(self, worker: Worker) -> tuple[bool, LoadReport | None, int]:
        """One ``/health`` and ``/load`` round trip for one worker."""
        try:
            health = await self.client.get(
                f"{worker.url}/health", timeout=self.timeout_s, headers=self.headers
            )
            if health.status_code != 200:
                return False, None, 0
            own = worker.in_flight
            load = await self.client.get(
                f"{worker.url}/load", timeout=self.timeout_s, headers=self.headers
            )
            own = max(own, worker.in_flight)
            data = load.json() if load.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as e:
            log.debug("health probe of %s failed: %r", worker.url, e)
            return False, None, 0
        return True, LoadReport.from_json(data) if isinstance(data, dict) else None, own

    async def check_all(self) -> None:
        """Probe every worker once, concurrently, and report each outcome."""
        workers = self.workers()
        results = await asyncio.gather(*(self.probe(w) for w in workers))
        for w, (ok, load, own) in zip(workers, results, strict=True):
            self.report(w.url, ok, load, own)

    async def run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
