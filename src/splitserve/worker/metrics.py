"""Prometheus metrics of one worker, named ``splitserve:*`` (vLLM's names where one exists).

Each app gets its own ``CollectorRegistry`` so several workers can live in one process (tests).
Gauges read the engine thread's last ``LoadSnapshot`` at scrape time; latencies are measured
on the event loop as outputs arrive, which is what a client sees minus the network.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from splitserve.engine.outputs import RequestOutput
from splitserve.worker.async_engine import LoadSnapshot

_STEP_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12,
)  # fmt: skip
_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip


class WorkerMetrics:
    """The worker's metrics; ``track()`` returns a per-request recorder."""

    def __init__(self, load: Callable[[], LoadSnapshot]) -> None:
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # process_cpu_seconds_total, resident memory, open fds
        self._gauge("num_requests_running", "Requests in the running batch", r).set_function(
            lambda: load().running
        )
        self._gauge("num_requests_waiting", "Requests waiting to be scheduled", r).set_function(
            lambda: load().waiting
        )
        self._gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", r).set_function(
            lambda: _usage(load())
        )
        self._gauge("kv_cache_blocks_total", "KV blocks in the pool", r).set_function(
            lambda: load().kv_blocks_total
        )
        self.ttft = self._histogram("time_to_first_token_seconds", "Time to first token", r)
        self.itl = self._histogram("inter_token_latency_seconds", "Time between tokens", r)
        self.e2e = self._histogram("e2e_request_latency_seconds", "Request latency", r)
        self.engine_step = Histogram(
            "splitserve:engine_step_seconds",
            "Duration of one engine step (schedule, model run, sampling, outputs)",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.engine_cpu = Counter(
            "splitserve:engine_cpu_seconds",
            "CPU time of the engine thread in its steps (with one model thread, the model's "
            "compute; the rest of process_cpu_seconds_total is serving: HTTP, streams, KV moves)",
            registry=r,
        )
        self.prompt_tokens = Counter("splitserve:prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "splitserve:generation_tokens", "Generated tokens", registry=r
        )
        self.cached_tokens = Counter(
            "splitserve:cached_prompt_tokens",
            "Prompt tokens served from the prefix cache",
            registry=r,
        )
        self.request_success = Counter(
            "splitserve:request_success", "Finished requests", ["finished_reason"], registry=r
        )
        self.request_errors = Counter(
            "splitserve:request_errors", "Requests answered with an error", ["status"], registry=r
        )
        self.quota_rejections = Counter(
            "splitserve:quota_rejections",
            "Requests refused with a 429 for passing a tenant's or session's limit",
            ["limit"],
            registry=r,
        )
        self._disaggregation_metrics(r)
        self._peer_metrics(r)

    def step(self, wall_s: float, cpu_s: float) -> None:
        """One engine step took ``wall_s`` seconds, ``cpu_s`` of them on the engine thread."""
        self.engine_step.observe(wall_s)
        self.engine_cpu.inc(cpu_s)

    def _disaggregation_metrics(self, r: CollectorRegistry) -> None:
        self.prefills = Counter(
            "splitserve:prefills",
            "Prompts by where their KV was computed (remote: pulled from a prefill worker)",
            ["where"],
            registry=r,
        )
        self.kv_fallbacks = Counter(
            "splitserve:kv_load_fallbacks",
            "Remote KV loads that failed and fell back to a local prefill",
            ["reason"],
            registry=r,
        )
        self.kv_blocks_received = Counter(
            "splitserve:kv_blocks_received",
            "KV blocks pulled from prefill workers and peers",
            registry=r,
        )
        self.kv_local_tier_blocks = Counter(
            "splitserve:kv_blocks_from_local_tiers",
            "KV blocks a decode worker took from its own host RAM or disk instead of pulling",
            registry=r,
        )
        self.kv_bytes_received = Counter(
            "splitserve:kv_bytes_received",
            "KV bytes pulled from prefill workers and peers",
            registry=r,
        )
        self.kv_transfer_seconds = Histogram(
            "splitserve:kv_transfer_seconds",
            "Duration of one KV pull",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_leases_granted = Counter(
            "splitserve:kv_leases_granted",
            "KV leases granted: prompts kept for a remote decode, prefixes lent to peers",
            registry=r,
        )
        self.kv_leases_ended = Counter(
            "splitserve:kv_leases_ended", "KV leases ended, by reason", ["reason"], registry=r
        )
        self.kv_blocks_sent = Gauge(
            "splitserve:kv_blocks_sent", "KV blocks sent to decode workers and peers", registry=r
        )
        self.kv_bytes_sent = Gauge(
            "splitserve:kv_bytes_sent", "KV bytes sent to decode workers and peers", registry=r
        )

    def _peer_metrics(self, r: CollectorRegistry) -> None:
        counter = self._counter
        self.kv_peer_fetches = counter(
            "kv_peer_fetches",
            "Requests naming a kv_peer, by outcome (pulled, held_locally, nothing_held, "
            "nothing_new, fallback)",
            r,
            ["outcome"],
        )
        self.kv_peer_fallbacks = counter(
            "kv_peer_fallbacks",
            "Peer KV fetches that failed and left the prompt to local compute, by reason",
            r,
            ["reason"],
        )
        self.kv_peer_blocks_received = counter(
            "kv_peer_blocks_received",
            "KV blocks pulled from peers (also counted in kv_blocks_received)",
            r,
        )
        self.kv_peer_leases = counter(
            "kv_peer_leases",
            "Lease requests from peers, by outcome (granted, empty: no block held)",
            r,
            ["outcome"],
        )

    @staticmethod
    def _counter(
        name: str, doc: str, registry: CollectorRegistry, labels: Sequence[str] = ()
    ) -> Counter:
        return Counter(f"splitserve:{name}", doc, list(labels), registry=registry)

    @staticmethod
    def _gauge(name: str, doc: str, registry: CollectorRegistry) -> Gauge:
        return Gauge(f"splitserve:{name}", doc, registry=registry)

    @staticmethod
    def _histogram(name: str, doc: str, registry: CollectorRegistry) -> Histogram:
        return Histogram(f"splitserve:{name}", doc, buckets=_LATENCY_BUCKETS, registry=registry)

    def track(self, on_finish: Callable[[RequestOutput], None] | None = None) -> RequestTracker:
        return RequestTracker(self, on_finish)


class RequestTracker:
    """Times one request's outputs and counts its tokens when it finishes; then calls
    ``on_finish`` with the final output."""

    __slots__ = ("_m", "_start", "_last", "_on_finish")

    def __init__(
        self, metrics: WorkerMetrics, on_finish: Callable[[RequestOutput], None] | None = None
    ) -> None:
        self._m = metrics
        self._start = time.perf_counter()
        self._last: float | None = None
        self._on_finish = on_finish

    def on_output(self, out: RequestOutput) -> None:
        t = time.perf_counter()
        if self._last is None:
            self._m.ttft.observe(t - self._start)
        else:
            self._m.itl.observe(t - self._last)
        self._last = t
        if out.finished:
            self._finish(out, t)

    def _finish(self, out: RequestOutput, t: float) -> None:
        m = self._m
        m.e2e.observe(t - self._start)
        m.prompt_tokens.inc(len(out.prompt_token_ids))
        m.generation_tokens.inc(len(out.outputs[0].token_ids))
        m.cached_tokens.inc(out.num_cached_tokens)
        m.request_success.labels(out.outputs[0].finish_reason or "unknown").inc()
        if self._on_finish is not None:
            self._on_finish(out)


def _usage(load: LoadSnapshot) -> float:
    return load.kv_blocks_used / load.kv_blocks_total if load.kv_blocks_total else 0.0
