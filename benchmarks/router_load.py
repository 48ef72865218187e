"""The load of ``router_overhead.py``: streaming clients with three arrival shapes, the
statistics of when requests arrived, and the router's own phase histograms.

Arrival shapes (``--arrivals``); every path of a run gets the identical plan:

- ``lockstep``: ``clients`` closed-loop clients start together, each sends its requests back
  to back, all of ``max_tokens``: identical paced streams end together and are re-sent
  together, so requests arrive in waves of ``clients``.
- ``staggered``: the same closed loop, client i starting i/clients of one request's duration
  late, and each request's length drawn from [max_tokens/2, 3*max_tokens/2] (seeded).
- ``poisson``: open loop; requests arrive at exponential intervals at a rate giving a mean
  concurrency of ``clients`` (Little's law: rate = clients / mean duration), lengths drawn
  as above, whether or not earlier requests have finished.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import math
import random
import ssl
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import aiohttp
import httpx
from prometheus_client.parser import text_string_to_metric_families

ARRIVALS = ("lockstep", "staggered", "poisson")
PHASE_FAMILY = "splitserve:router_request_phase_seconds"
BURST_WINDOW_S = 0.005
_JSON = {"content-type": "application/json"}
_NO_DEADLINE = aiohttp.ClientTimeout(total=None, sock_read=120.0)


class Timing(NamedTuple):
    sent_s: float  # when the request was sent, from the run's start
    total_s: float  # request sent to last byte
    first_s: float  # request sent to first body chunk


class Run(NamedTuple):
    timings: list[Timing]
    rps: float


class Plan(NamedTuple):
    """Closed loop: ``starts[i]`` and ``bodies[i]`` (client i's requests, in order).
    Open loop (``starts`` is None): ``arrivals[k]`` and ``bodies[0][k]``."""

    starts: list[float] | None
    arrivals: list[float] | None
    bodies: list[list[bytes]]


def make_plan(
    arrivals: str, clients: int, requests: int, body: dict, duration_s: float, seed: int
) -> Plan:
    """The load for one run: ``duration_s`` is one request's mean duration (calibrated)."""
    rng = random.Random(seed)
    m = body["max_tokens"]

    def encode(client: int, varied: bool) -> bytes:
        tokens = rng.randint(max(1, round(m / 2)), max(1, round(3 * m / 2))) if varied else m
        return json.dumps({**body, "user": f"client-{client}", "max_tokens": tokens}).encode()

    if arrivals == "poisson":
        rate, t, times, bodies = clients / duration_s, 0.0, [], []
        for k in range(clients * requests):
            times.append(t)
            bodies.append(encode(k % clients, True))
            t += rng.expovariate(rate)
        return Plan(None, times, [bodies])
    varied = arrivals == "staggered"
    starts = [i * duration_s / clients if varied else 0.0 for i in range(clients)]
    bodies = [[encode(i, varied) for _ in range(requests)] for i in range(clients)]
    return Plan(starts, None, bodies)


async def one_stream(
    session: aiohttp.ClientSession, url: str, body: bytes, origin: float
) -> Timing:
    start = time.perf_counter()
    first = None
    async with session.post(url + "/v1/chat/completions", data=body, headers=_JSON) as r:
        r.raise_for_status()
        async for _ in r.content.iter_any():
            if first is None:
                first = time.perf_counter() - start
    return Timing(start - origin, time.perf_counter() - start, first or 0.0)


async def load_run(
    url: str,
    clients: int,
    plan: Plan,
    warm_body: bytes,
    warmed: Callable[[], None] = lambda: None,
    tls: ssl.SSLContext | None = None,
    headers: dict[str, str] | None = None,
) -> Run:
    """Run ``plan`` against ``url`` after a warm-up wave; ``warmed`` is called in between
    (nothing is in flight then: it may read the server's counters). ``tls``: what an
    https:// ``url`` is verified against (its handshakes happen in the warm-up wave);
    ``headers``: sent with every request (an API key)."""
    # aiohttp, as the router uses: the load generator shares a core with the worker and must
    # cost little per streamed chunk, or it, not the path under test, sets the latencies.
    # Open loop: no connection limit, so a burst of arrivals is not queued in the client.
    limit = clients if plan.starts is not None else 0
    connector = aiohttp.TCPConnector(limit=limit, ssl=True if tls is None else tls)
    async with aiohttp.ClientSession(
        connector=connector, timeout=_NO_DEADLINE, headers=headers
    ) as session:
        origin = time.perf_counter()
        await asyncio.gather(*(one_stream(session, url, warm_body, origin) for _ in range(clients)))
        warmed()
        origin = time.perf_counter()
        if plan.starts is not None:
            results = await asyncio.gather(
                *(
                    _client(session, url, start, bodies, origin)
                    for start, bodies in zip(plan.starts, plan.bodies, strict=True)
                )
            )
            timings = [t for r in results for t in r]
        else:
            timings = await _open_loop(session, url, plan, origin)
        elapsed = time.perf_counter() - origin
    return Run(timings, len(timings) / elapsed)


async def _client(
    session: aiohttp.ClientSession, url: str, start: float, bodies: list[bytes], origin: float
) -> list[Timing]:
    await _sleep_until(origin + start)
    return [await one_stream(session, url, b, origin) for b in bodies]


async def _open_loop(
    session: aiohttp.ClientSession, url: str, plan: Plan, origin: float
) -> list[Timing]:
    assert plan.arrivals is not None
    tasks = []
    for at, body in zip(plan.arrivals, plan.bodies[0], strict=True):
        await _sleep_until(origin + at)
        tasks.append(asyncio.ensure_future(one_stream(session, url, body, origin)))
    return list(await asyncio.gather(*tasks))


async def _sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def mean_duration(
    url: str,
    clients: int,
    body: bytes,
    tls: ssl.SSLContext | None = None,
    headers: dict[str, str] | None = None,
) -> float:
    """One lockstep wave of ``clients`` requests: their mean duration (the calibration)."""
    plan = Plan([0.0] * clients, None, [[body]] * clients)
    run = await load_run(url, clients, plan, body, tls=tls, headers=headers)
    return statistics.mean(t.total_s for t in run.timings)


def bursts(timings: list[Timing], window_s: float = BURST_WINDOW_S) -> list[int]:
    """For each request, how many requests (itself included) were sent in the ``window_s``
    before it: ~``clients`` in lockstep waves, ~1 for spread arrivals."""
    sent = sorted(t.sent_s for t in timings)
    return [i - bisect.bisect_left(sent, s - window_s) + 1 for i, s in enumerate(sent)]


# ---- the router's phase histograms -------------------------------------------------------


def scrape_phases(url: str, tls: ssl.SSLContext | None = None) -> dict[str, dict[float, float]]:
    """``{phase: {le: cumulative count, ..., "sum": seconds}}`` from the router's /metrics."""
    text = httpx.get(url + "/metrics", timeout=10.0, verify=True if tls is None else tls).text
    out: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != PHASE_FAMILY:
            continue
        for s in family.samples:
            phase = out.setdefault(s.labels["phase"], {})
            if s.name.endswith("_bucket"):
                phase[float(s.labels["le"])] = s.value
            elif s.name.endswith("_sum"):
                phase[-1.0] = s.value  # the sum, under a key no bucket has
    return out


def phase_deltas(
    before: dict[str, dict[float, float]], after: dict[str, dict[float, float]]
) -> dict[str, dict[float, float]]:
    """What one run added to each phase's histogram."""
    return {
        phase: {le: v - before.get(phase, {}).get(le, 0.0) for le, v in buckets.items()}
        for phase, buckets in after.items()
    }


def merge(a: dict[str, dict[float, float]], b: dict[str, dict[float, float]]) -> dict:
    out = {phase: dict(buckets) for phase, buckets in a.items()}
    for phase, buckets in b.items():
        target = out.setdefault(phase, {})
        for le, v in buckets.items():
            target[le] = target.get(le, 0.0) + v
    return out


def bucket_quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus's ``histogram_quantile``: linear within the bucket that holds rank q."""
    les = sorted(le for le in buckets if le >= 0)
    total = buckets[math.inf] if les else 0.0
    if total <= 0:
        return math.nan
    rank, prev_le, prev_count = q * total, 0.0, 0.0
    for le in les:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_count) / max(count - prev_count, 1e-12)
        prev_le, prev_count = le, count
    return prev_le


def phase_summary(buckets: dict[float, float]) -> tuple[float, float, float, float]:
    """(requests, mean, p50, p99) of one phase, in seconds."""
    count = buckets.get(math.inf, 0.0)
    mean = buckets.get(-1.0, 0.0) / count if count else math.nan
    return count, mean, bucket_quantile(0.5, buckets), bucket_quantile(0.99, buckets)
