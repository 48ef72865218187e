"""The router's Prometheus metrics, named ``splitserve:router_*``.

Each app has its own ``CollectorRegistry`` so several routers can live in one process.
"Home" is where the session policy would put a turn if every worker had room; the fraction
of turns served there is the stickiness the prefix caches depend on.
"""

from __future__ import annotations

from collections import Counter as Counter_
from collections import OrderedDict
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from splitserve.router.timing import PHASE_BUCKETS, PHASE_NAMES, Timeline

_LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_REMEMBERED_SESSIONS = 100_000  # bounds the memory spent on the "sessions moved" count


class RouterMetrics:
    """Counters the proxy bumps; ``turn()`` also tracks home turns and moved sessions."""

    def __init__(self, healthy: Callable[[str], int]) -> None:
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # process_cpu_seconds_total, resident memory, open fds
        self.requests = Counter(
            "splitserve:router_requests", "Requests sent to workers", ["worker", "role"], registry=r
        )
        self.failures = Counter(
            "splitserve:router_worker_failures",
            "Connection errors and 5xx answers from workers",
            ["worker", "role"],
            registry=r,
        )
        self.quota_rejections = Counter(
            "splitserve:router_quota_rejections",
            "Requests refused with a 429 for passing a tenant's or session's in-flight limit",
            ["limit"],
            registry=r,
        )
        self.retries = Counter(
            "splitserve:router_retries",
            "Requests retried on another worker before the first byte",
            ["role"],
            registry=r,
        )
        self.migrations = Counter(
            "splitserve:router_migrations",
            "Streams resumed on another decode worker after a failure",
            registry=r,
        )
        self.replay_divergences = Counter(
            "splitserve:router_replay_divergences",
            "Replayed streams (vLLM workers) ended because the replay differed from what the "
            "client had",
            registry=r,
        )
        self.response_searches = Counter(
            "splitserve:router_response_searches",
            "/v1/responses turns sent on to another worker: the one asked lacked the previous "
            "response",
            registry=r,
        )
        self.midstream_failures = Counter(
            "splitserve:router_midstream_failures",
            "Streams whose worker failed after the first byte",
            registry=r,
        )
        self.remote_prefills = Counter(
            "splitserve:router_remote_prefills",
            "Two-leg requests by outcome (ok, fallback, skipped)",
            ["outcome"],
            registry=r,
        )
        self.sessions_moved = Counter(
            "splitserve:router_sessions_moved",
            "Turns placed on another worker than the session's last",
            registry=r,
        )
        self.turns = Counter("splitserve:router_turns", "Turns with a session key", registry=r)
        self.kv_peer_hints = Counter(
            "splitserve:router_kv_peer_hints",
            "Turns placed off their healthy home worker that named it (kv_peer) to pull from",
            registry=r,
        )
        self.home_turns = Counter(
            "splitserve:router_home_turns", "Turns served on the session's home worker", registry=r
        )
        Gauge(
            "splitserve:router_home_turn_fraction",
            "Fraction of turns on their home worker",
            registry=r,
        ).set_function(self.home_fraction)
        healthy_gauge = Gauge(
            "splitserve:router_healthy_workers", "Healthy workers by role", ["role"], registry=r
        )
        for role in ("both", "decode", "prefill"):
            healthy_gauge.labels(role).set_function(lambda role=role: healthy(role))
        self.latency = Histogram(
            "splitserve:router_time_to_headers_seconds",
            "Time from request to the worker's response headers",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        phases = Histogram(
            "splitserve:router_request_phase_seconds",
            "Where a request's time goes in the router (splitserve.router.timing)",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        # Children looked up once: ``labels()`` validates and locks on every call.
        self._phases = {name: phases.labels(name) for name in PHASE_NAMES}
        self._children: dict[tuple[Counter, str, str], Counter] = {}
        self._last_worker: OrderedDict[str, str] = OrderedDict()
        self._turns = 0
        self._home_turns = 0

    def sent(self, worker: str, role: str) -> None:
        """A request went to ``worker`` for its ``role`` leg."""
        self._child(self.requests, worker, role).inc()

    def failed(self, worker: str, role: str) -> None:
        self._child(self.failures, worker, role).inc()

    def _child(self, counter: Counter, worker: str, role: str) -> Counter:
        key = (counter, worker, role)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = counter.labels(worker, role)
        return child

    def timeline(self, timeline: Timeline) -> None:
        """Observe a finished request's phases."""
        for name, seconds in timeline.phases():
            self._phases[name].observe(seconds)

    def turn(self, session: str, worker: str, home: str | None) -> None:
        """One turn of ``session`` went to ``worker``; ``home`` is where it belonged."""
        self.turns.inc()
        self._turns += 1
        if worker == home:
            self.home_turns.inc()
            self._home_turns += 1
        last = self._last_worker.pop(session, None)
        if last is not None and last != worker:
            self.sessions_moved.inc()
        self._last_worker[session] = worker
        if len(self._last_worker) > _REMEMBERED_SESSIONS:
            self._last_worker.popitem(last=False)

    def sessions_by_worker(self) -> Counter_[str]:
        """How many of the remembered sessions each worker served last."""
        return Counter_(self._last_worker.values())

    def home_fraction(self) -> float:
        return self._home_turns / self._turns if self._turns else 1.0
