"""Drive a workload against an endpoint: open loop at a rate, or closed loop at a concurrency.

Open loop (``rate``): every session arriving before ``duration_s`` starts at its arrival
time, whether or not the server keeps up, so an overloaded server shows as latency, not
as a slower client. Closed loop (``concurrency``): that many sessions are in flight; each
slot starts the next session as soon as its last one ends, until ``duration_s``. Either
way, sessions still running ``drain_s`` after that are cut off and their current turn
counts as failed. The run's duration runs from the start to the last reply.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm import tqdm

from splitserve.bench.client import Endpoint, SessionPlayer, new_client
from splitserve.bench.scrape import Targets, discover, scrape, server_figures
from splitserve.workload.metrics import SLO, summarize
from splitserve.workload.runs import Load, RunResult
from splitserve.workload.sessions import SessionSpec, Workload, within

# Below the workloads' id ranges, so that the warm-up never seeds the cache with their blocks.
WARMUP_PROMPT = list(range(200, 232))


async def run_load(
    endpoint: Endpoint,
    workload: Workload,
    load: Load,
    slo: SLO | None = None,
    progress: bool = True,
    metrics_urls: Sequence[str] = (),
) -> RunResult:
    """Play ``workload`` at ``load`` against ``endpoint``: the records, and their summary
    with the servers' counters (after - before) and the run's description in ``info``."""
    async with new_client(ca=endpoint.ca) as client:
        targets = await discover(client, endpoint, tuple(metrics_urls))
        await warm_up(client, endpoint, max(2, len(targets.workers)))
        before = await scrape(client, targets, endpoint.headers)
        cpu = time.process_time()
        records, duration = await _play(client, endpoint, workload, load, progress)
        cpu = time.process_time() - cpu
        after = await scrape(client, targets, endpoint.headers)
    info: dict[str, Any] = {
        "workload": workload.describe(),
        "load": load.describe(),
        "url": endpoint.url,
    }
    if targets.listed:  # the router's workers: the simulator places on the same rings
        info["workers"] = [{"url": url, "role": role} for url, role in targets.listed]
    server = _server(targets, before, after, cpu)
    summary = summarize(records, duration, slo or SLO(), server, info)
    return RunResult(summary, records)


def _server(targets: Targets, before: dict, after: dict, client_cpu_s: float) -> dict[str, float]:
    if not targets.workers:
        return {}
    return {**server_figures(before, after), "client_cpu_seconds": client_cpu_s}


async def warm_up(client, endpoint: Endpoint, n: int) -> None:
    """A few tiny requests, so that first-call costs stay out of the measurement; a server
    that fails them fails the run's requests too, where they are counted."""
    body = {"prompt": WARMUP_PROMPT, "max_tokens": 2, "ignore_eos": True}
    if endpoint.model:
        body["model"] = endpoint.model
    await asyncio.gather(
        *(
            client.post(endpoint.url + "/v1/completions", json=body, headers=endpoint.headers)
            for _ in range(n)
        ),
        return_exceptions=True,
    )


async def _play(client, endpoint, workload: Workload, load: Load, progress: bool):
    t0 = time.perf_counter()
    if load.rate is not None:
        sessions = list(within(workload.sessions(load.rate), load.duration_s))
        total = sum(len(s.turns) for s in sessions)
    else:
        sessions, total = workload.sessions(None), None
    with tqdm(total=total, disable=not progress, unit="req", desc=workload.name) as bar:
        player = SessionPlayer(client, endpoint, t0, lambda r: bar.update())
        if load.rate is not None:
            tasks = await _open_loop(player, sessions)
        else:
            tasks = _closed_loop(player, sessions, load)
        await _drain(tasks, load.duration_s + load.drain_s - player.now())
    records = player.records
    end = max((r.end_s for r in records), default=time.perf_counter() - t0)
    return records, end


async def _open_loop(player: SessionPlayer, sessions: list[SessionSpec]) -> list[asyncio.Task]:
    tasks = []
    for s in sessions:
        delay = s.arrival_s - player.now()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(player.play(s)))
    return tasks


def _closed_loop(
    player: SessionPlayer, sessions: Iterator[SessionSpec], load: Load
) -> list[asyncio.Task]:
    async def slot() -> None:
        while player.now() < load.duration_s:
            spec = next(sessions, None)
            if spec is None:
                return
            await player.play(spec.at(player.now()))

    return [asyncio.create_task(slot()) for _ in range(load.concurrency or 0)]


async def _drain(tasks: list[asyncio.Task], timeout_s: float) -> None:
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, timeout_s))
    for t in pending:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def sweep(
    endpoint: Endpoint,
    workload: Workload,
    loads: Sequence[Load],
    slo: SLO | None = None,
    progress: bool = True,
    metrics_urls: Sequence[str] = (),
) -> list[RunResult]:
    """One run per load, each with its own seed (seed + i): a later run must not find the
    earlier one's conversations cached."""
    results = []
    for i, load in enumerate(loads):
        wl = dataclasses.replace(workload, seed=workload.seed + i) if i else workload
        results.append(asyncio.run(run_load(endpoint, wl, load, slo, progress, metrics_urls)))
    return results
