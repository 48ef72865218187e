"""The servers' own counters, read from ``/metrics`` before and after a run.

Behind a router the workers are found through its ``/workers`` endpoint (it needs the admin
key, which defaults to the API key); a plain worker is scraped directly. Figures are sums
over all workers of after - before:

- ``prefix_cache_hit_rate``: cached prompt tokens / prompt tokens. On a decode worker the
  blocks pulled from a prefill worker count as cached too, as its scheduler sees them.
- ``prefill_tokens_computed``: prompt tokens minus cached ones, the prefill work done.
- ``kv_bytes_transferred``: KV bytes decode workers pulled from prefill workers.
- ``remote_prefills``: the router's two-leg requests that went through.
- ``turns_moved_fraction``: of the turns with a session key, those the router placed on
  another worker than the session's previous turn (each such turn finds none of the
  session's own KV there).
- Where the host's CPU went: ``engine_cpu_seconds`` (the workers' engine threads in their
  steps: with one model thread per worker, the model's compute), ``worker_cpu_seconds``
  (the worker processes in all, so the difference is serving: HTTP, streams, KV moves),
  ``router_cpu_seconds``, and ``engine_busy_seconds`` (the steps' wall time, which exceeds
  their CPU time when workers wait for a shared core). ``run_load`` adds the load
  generator's own, ``client_cpu_seconds``.
- ``kv_blocks_saved`` / ``kv_blocks_loaded``: KV blocks the workers' tiers copied below the
  device pool / loaded back into it (0 without tiers).
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from splitserve.bench.client import Endpoint

WORKER_COUNTERS = {
    "prompt_tokens": "splitserve:prompt_tokens_total",
    "cached_prompt_tokens": "splitserve:cached_prompt_tokens_total",
    "generation_tokens": "splitserve:generation_tokens_total",
    "requests_finished": "splitserve:request_success_total",
    "kv_bytes_transferred": "splitserve:kv_bytes_received_total",
    "engine_busy_seconds": "splitserve:engine_step_seconds_sum",
    "engine_cpu_seconds": "splitserve:engine_cpu_seconds_total",
    "worker_cpu_seconds": "process_cpu_seconds_total",
    "kv_blocks_saved": "splitserve:kv_tier_saved_blocks_total",
    "kv_blocks_loaded": "splitserve:kv_tier_loaded_blocks_total",
}
ROUTER_COUNTERS = {
    "remote_prefills": 'splitserve:router_remote_prefills_total{outcome="ok"}',
    "session_turns": "splitserve:router_turns_total",
    "turns_moved": "splitserve:router_sessions_moved_total",
    "router_cpu_seconds": "process_cpu_seconds_total",
}


@dataclass(frozen=True, slots=True)
class Targets:
    workers: tuple[str, ...]
    router: str | None = None
    # (url, role) of each worker the router listed: where its hash rings place requests
    listed: tuple[tuple[str, str], ...] = ()


async def discover(client: httpx.AsyncClient, endpoint: Endpoint, extra=()) -> Targets:
    """The workers behind ``endpoint`` (the endpoint itself when it is a worker)."""
    try:
        r = await client.get(endpoint.url + "/workers", headers=endpoint.headers)
    except httpx.HTTPError:
        return Targets((endpoint.url, *extra))
    if r.status_code == 200:
        listed = tuple((w["url"], w.get("role", "both")) for w in r.json().get("workers", []))
        return Targets((*(url for url, _ in listed), *extra), endpoint.url, listed)
    if r.status_code in (401, 403):  # a router that will not tell
        return Targets(tuple(extra), endpoint.url)
    return Targets((endpoint.url, *extra))


async def scrape(client: httpx.AsyncClient, targets: Targets, headers=None) -> dict[str, float]:
    """The counters summed over ``targets``; an unreachable server counts as zeros."""
    totals = dict.fromkeys([*WORKER_COUNTERS, *ROUTER_COUNTERS], 0.0)
    pairs = [(url, WORKER_COUNTERS) for url in targets.workers]
    if targets.router:
        pairs.append((targets.router, ROUTER_COUNTERS))
    for url, names in pairs:
        try:
            r = await client.get(url + "/metrics", headers=headers)
        except httpx.HTTPError:
            continue
        if r.status_code != 200:
            continue
        samples = _samples(r.text)
        for key, name in names.items():
            totals[key] += samples.get(name, 0.0)
    return totals


def _samples(text: str) -> dict[str, float]:
    """``name`` -> value summed over label sets, and ``name{k="v"}`` -> value."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            if labels:
                out[f"{s.name}{{{labels}}}"] = s.value
    return out


def serving_cpu_seconds(figures: dict[str, float]) -> float:
    """A run's CPU seconds outside the engine threads' steps: the rest of the workers, the
    router and the load generator (``run_load``'s figures)."""
    worker = figures["worker_cpu_seconds"] - figures["engine_cpu_seconds"]
    return worker + figures["router_cpu_seconds"] + figures["client_cpu_seconds"]


def server_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The run's share of the servers' counters, and the hit rate derived from them."""
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    prompt, turns = delta["prompt_tokens"], delta["session_turns"]
    return {
        "prefix_cache_hit_rate": delta["cached_prompt_tokens"] / prompt if prompt else 0.0,
        "turns_moved_fraction": delta["turns_moved"] / turns if turns else 0.0,
        "prefill_tokens_computed": prompt - delta["cached_prompt_tokens"],
        **delta,
    }
