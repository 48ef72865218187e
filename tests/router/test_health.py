"""Circuit breakers with an injected clock; membership filtering; the probe loop."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from splitserve.router.health import (
    BreakerState,
    CircuitBreaker,
    HealthChecker,
    load_from_metrics,
)
from splitserve.router.membership import BreakerConfig, Membership
from splitserve.router.worker import LoadReport, Worker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_k_consecutive_failures():
    b = CircuitBreaker(failure_threshold=3, cooldown_s=5.0, clock=Clock())
    b.record_failure()
    b.record_failure()
    b.record_success()  # resets the count
    b.record_failure()
    b.record_failure()
    assert b.state is BreakerState.CLOSED and b.allows()
    b.record_failure()
    assert b.state is BreakerState.OPEN and not b.allows()


def test_breaker_half_opens_after_cooldown_then_closes_on_success():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=1, cooldown_s=5.0, clock=clock)
    b.record_failure()
    clock.now += 4.9
    assert not b.allows()
    clock.now += 0.1
    assert b.allows() and b.state is BreakerState.HALF_OPEN
    b.record_success()
    assert b.state is BreakerState.CLOSED


def test_failed_trial_reopens_and_restarts_the_cooldown():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=3, cooldown_s=5.0, clock=clock)
    for _ in range(3):
        b.record_failure()
    clock.now += 5
    assert b.allows()
    b.record_failure()  # one failure is enough in HALF_OPEN
    assert b.state is BreakerState.OPEN
    clock.now += 4
    assert not b.allows()


def test_membership_filters_by_role_health_and_exclusions():
    clock = Clock()
    m = Membership(
        [Worker("http://a", "decode"), Worker("http://b", "both"), Worker("http://p", "prefill")],
        BreakerConfig(failure_threshold=1, cooldown_s=2.0),
        clock=clock,
    )
    assert [w.url for w in m.candidates("decode")] == ["http://a", "http://b"]
    assert [w.url for w in m.candidates("prefill")] == ["http://b", "http://p"]
    m.report("http://a", ok=False)
    assert [w.url for w in m.candidates("decode")] == ["http://b"]
    assert m.candidates("decode", exclude=["http://b"]) == []
    clock.now += 2
    assert [w.url for w in m.candidates("decode")] == ["http://a", "http://b"]


def test_membership_add_remove_and_load_reports():
    m = Membership()
    assert m.add(Worker("http://a/", "decode"))
    assert not m.add(Worker("http://a", "both"))
    assert m.get("http://a").role == "both"
    m.report("http://a", ok=True, load=LoadReport(running=2, waiting=1))
    assert m.get("http://a").load == 3
    assert m.remove("http://a/") is not None
    m.report("http://a", ok=True)  # a late probe of a removed worker is ignored
    assert m.all() == []


def test_load_report_ignores_bad_fields():
    r = LoadReport.from_json({"running": 2, "waiting": "x", "kv_blocks_used": -1, "extra": 1})
    assert r == LoadReport(running=2)


def test_health_checker_probes_and_reports():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "down":
            raise httpx.ConnectError("refused")
        if request.url.host == "sick":
            return httpx.Response(503, json={"status": "engine not running"})
        if request.url.path == "/load":
            assert request.headers["authorization"] == "Bearer k"
            return httpx.Response(200, json={"running": 1, "waiting": 2})
        return httpx.Response(200, json={"status": "ok"})

    m = Membership(
        [Worker(u) for u in ("http://up", "http://down", "http://sick")],
        BreakerConfig(failure_threshold=1),
    )

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            checker = HealthChecker(client, m.all, m.report, headers={"authorization": "Bearer k"})
            await checker.check_all()

    asyncio.run(main())
    assert [w.url for w in m.candidates("decode")] == ["http://up"]
    assert m.get("http://up").report == LoadReport(running=1, waiting=2)


VLLM_METRICS = Path(__file__).parent / "data" / "vllm-0.32-metrics-busy.txt"  # a real scrape


def test_load_from_a_vllm_servers_metrics():
    report = load_from_metrics(VLLM_METRICS.read_text())
    # The scrape was taken with six requests running, none waiting, 3.3% of the KV in use.
    assert report == LoadReport(running=6, waiting=0, kv_blocks_used=33, kv_blocks_total=1000)
    assert load_from_metrics("# nothing of vLLM's here\nother_gauge 1.0\n") is None


@pytest.mark.parametrize(
    "load",
    [
        httpx.Response(404, json={"detail": "Not Found"}),
        httpx.Response(200, json={"server_load": 0}),  # what vLLM's own /load answers
    ],
)
def test_a_worker_without_our_load_is_probed_through_its_metrics_from_then_on(load):
    paths: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        if request.url.path == "/load":
            return load
        if request.url.path == "/metrics":
            return httpx.Response(200, text=VLLM_METRICS.read_text())
        return httpx.Response(200)

    m = Membership([Worker("http://vllm")])

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            checker = HealthChecker(client, m.all, m.report)
            await checker.check_all()
            await checker.check_all()

    asyncio.run(main())
    assert paths == ["/health", "/load", "/metrics", "/health", "/metrics"]
    assert m.get("http://vllm").report.running == 6
