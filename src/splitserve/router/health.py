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
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from splitserve.router.response import UpstreamError
from splitserve.router.upstream import Pool
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


# vLLM's gauges (per engine; summed). KV usage is a fraction: reported per mille.
_VLLM_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
}
KV_USAGE_SCALE = 1000


def load_from_metrics(text: str) -> LoadReport | None:
    """A ``LoadReport`` from a vLLM server's Prometheus text (None when it has none of the
    gauges). KV use becomes ``kv_blocks_used`` out of ``KV_USAGE_SCALE``."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        field_name = _VLLM_GAUGES.get(family.name) or _VLLM_GAUGES.get(f"{family.name}_total")
        if field_name is None:
            continue
        found[field_name] = sum(s.value for s in family.samples if s.name == family.name)
    if not found:
        return None
    return LoadReport(
        running=int(found.get("running", 0)),
        waiting=int(found.get("waiting", 0)),
        kv_blocks_used=round(found.get("kv_usage", 0.0) * KV_USAGE_SCALE),
        kv_blocks_total=KV_USAGE_SCALE if "kv_usage" in found else 0,
    )


class HealthChecker:
    """Probes every worker on an interval; outcomes go to ``report`` (the membership).

    ``report(url, ok, load, own)``: ``ok`` is False on a connection error, a timeout or a
    non-200 ``/health``; ``load`` is the parsed ``/load`` when it answered, and ``own`` the
    most requests this router had in flight there while ``/load`` was asked.
    """

    def __init__(
        self,
        client: Pool,
        workers: Callable[[], list[Worker]],
        report: Callable[[str, bool, LoadReport | None, int], None],
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
        headers: Callable[[str], dict[str, str]] | None = None,
    ) -> None:
        self.client = client
        self.workers = workers
        self.report = report
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.headers = headers or (lambda path: {})  # by path: a worker may want them signed
        self._metrics_only: set[str] = set()  # workers without /load: read /metrics
        self._task: asyncio.Task | None = None

    async def probe(self, worker: Worker) -> tuple[bool, LoadReport | None, int]:
        """One ``/health`` and load round trip for one worker: ``/load`` from a splitserve
        worker, Prometheus ``/metrics`` from one that has no ``/load`` (a vLLM server)."""
        try:
            status, _ = await self.client.fetch(
                worker.url, "/health", self.headers("/health"), self.timeout_s
            )
            if status != 200:
                return False, None, 0
            own = worker.in_flight
            load = await self._load(worker.url)
            own = max(own, worker.in_flight)
        except (UpstreamError, ValueError) as e:
            log.debug("health probe of %s failed: %r", worker.url, e)
            return False, None, 0
        return True, load, own

    async def _load(self, url: str) -> LoadReport | None:
        if url not in self._metrics_only:
            status, body = await self.client.fetch(
                url, "/load", self.headers("/load"), self.timeout_s
            )
            data = json.loads(body) if status == 200 else None
            if isinstance(data, dict) and "running" in data:
                return LoadReport.from_json(data)
            if status not in (200, 404):
                return None
            # No /load, or vLLM's own (``{"server_load": n}``, requests in its API server).
            self._metrics_only.add(url)
        status, body = await self.client.fetch(
            url, "/metrics", self.headers("/metrics"), self.timeout_s
        )
        return load_from_metrics(body.decode()) if status == 200 else None

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
