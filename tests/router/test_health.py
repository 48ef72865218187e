"""Circuit breakers with an injected clock; membership filtering; the probe loop."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from splitserve.router.health import (
    BreakerState,
    CircuitBreaker,
    HealthChecker,
    load_from_metrics,
)
from splitserve.router.membership import BreakerConfig, Membership
from splitserve.router.upstream import Pool
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


class CannedWorker:
    """A real HTTP server on loopback answering each path with a canned (status, body)."""

    def __init__(self, answers: dict[str, tuple[int, str]]) -> None:
        self.answers = answers
        self.requests: list[bytes] = []  # each request's head
        self.server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> CannedWorker:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    def paths(self) -> list[str]:
        return [head.split(b" ")[1].decode() for head in self.requests]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            self.requests.append(head)
            status, body = self.answers.get(head.split(b" ")[1].decode(), (404, "{}"))
            data = body.encode()
            writer.write(
                b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n%s" % (status, len(data), data)
            )
        writer.close()


def test_health_checker_probes_and_reports():
    health = (200, '{"status": "ok"}')

    async def main() -> tuple[list[str], CannedWorker]:
        up = await CannedWorker(
            {"/health": health, "/load": (200, '{"running": 1, "waiting": 2}')}
        ).start()
        sick = await CannedWorker({"/health": (503, '{"status": "engine not running"}')}).start()
        down = await CannedWorker({}).start()
        down.server.close()
        await down.server.wait_closed()
        urls = [up.url, down.url, sick.url]
        m = Membership([Worker(u) for u in urls], BreakerConfig(failure_threshold=1))
        pool = Pool(connect_timeout_s=1.0)
        checker = HealthChecker(
            pool, m.all, m.report, headers=lambda path: {"authorization": "Bearer k"}
        )
        await checker.check_all()
        await pool.close()
        assert m.get(up.url).report == LoadReport(running=1, waiting=2)
        return [w.url for w in m.candidates("decode")], up

    (serving, up) = asyncio.run(main())
    assert serving == [up.url]
    assert up.paths() == ["/health", "/load"]
    assert all(b"authorization: Bearer k\r\n" in head for head in up.requests)


VLLM_METRICS = Path(__file__).parent / "data" / "vllm-0.32-metrics-busy.txt"  # a real scrape


def test_load_from_a_vllm_servers_metrics():
    report = load_from_metrics(VLLM_METRICS.read_text())
    # The scrape was taken with six requests running, none waiting, 3.3% of the KV in use.
    assert report == LoadReport(running=6, waiting=0, kv_blocks_used=33, kv_blocks_total=1000)
    assert load_from_metrics("# nothing of vLLM's here\nother_gauge 1.0\n") is None


@pytest.mark.parametrize(
    "load",
    [
        (404, '{"detail": "Not Found"}'),
        (200, '{"server_load": 0}'),  # what vLLM's own /load answers
    ],
)
def test_a_worker_without_our_load_is_probed_through_its_metrics_from_then_on(load):
    async def main() -> tuple[list[str], int]:
        answers = {
            "/health": (200, "{}"),
            "/load": load,
            "/metrics": (200, VLLM_METRICS.read_text()),
        }
        vllm = await CannedWorker(answers).start()
        m = Membership([Worker(vllm.url)])
        pool = Pool()
        checker = HealthChecker(pool, m.all, m.report)
        await checker.check_all()
        await checker.check_all()
        await pool.close()
        return vllm.paths(), m.get(vllm.url).report.running

    paths, running = asyncio.run(main())
    assert paths == ["/health", "/load", "/metrics", "/health", "/metrics"]
    assert running == 6
